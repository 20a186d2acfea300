import pytest
from pydantic import ValidationError

from service.settings import ServiceSettings


def test_defaults_are_safe():
    s = ServiceSettings()
    assert s.host == "127.0.0.1" and s.ray_address is None and s.api_key() is None
    assert s.max_body_bytes > 0 and s.max_inflight > 0


def test_environment_variables_fill_settings(monkeypatch):
    monkeypatch.setenv("SPLITKEY_MAX_INFLIGHT", "3")
    monkeypatch.setenv("SPLITKEY_DEVICE", "gpu")
    s = ServiceSettings()
    assert s.max_inflight == 3 and s.device == "gpu"


def test_bad_values_are_refused_naming_the_field():
    with pytest.raises(ValidationError, match="max_inflight"):
        ServiceSettings(max_inflight=0)
    with pytest.raises(ValidationError, match="device"):
        ServiceSettings(device="tpu")
    with pytest.raises(ValidationError, match="ray_address"):
        ServiceSettings(ray_address=" ")
    with pytest.raises(ValidationError, match="unknown_setting"):
        ServiceSettings(unknown_setting=1)


def test_api_key_is_read_from_its_file(tmp_path):
    f = tmp_path / "key"
    f.write_text("  abc123\n")
    assert ServiceSettings(api_key_file=f).api_key() == "abc123"
    f.write_text("\n")
    with pytest.raises(ValueError, match="api_key_file must hold a non-empty token"):
        ServiceSettings(api_key_file=f).api_key()
