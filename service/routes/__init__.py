"""Thin HTTP routes: parse, call a service object from ``app.state.splitkey``, encode."""
