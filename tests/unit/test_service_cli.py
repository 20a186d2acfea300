import subprocess
import sys

import pytest

from service import cli_settings
from service.cli import build_parser, main
from service.client import Client


def test_serve_flags_parse():
    args = build_parser().parse_args(["serve", "--workers", "3", "--device", "cpu", "--port", "9000"])
    assert cli_settings.given(args) == {"workers": "3", "device": "cpu", "port": "9000"}  # the model parses them


def test_bad_settings_exit_2_with_a_message(capsys, tmp_path):
    assert main(["serve", "--max-inflight", "0"]) == 2
    assert "--max-inflight (SPLITKEY_MAX_INFLIGHT): Input should be greater than or equal to 1, got '0'" in \
        capsys.readouterr().err
    empty = tmp_path / "key"
    empty.write_text("")
    empty.chmod(0o600)
    assert main(["serve", "--api-key-file", str(empty)]) == 2
    assert "--api-key-file (SPLITKEY_API_KEY_FILE)" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "loadtest"])
def test_an_unknown_flag_is_named_with_the_commands_own_usage(capsys, command):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--url", "http://127.0.0.1:1", "--bogus"] if command == "loadtest" else [command, "--bogus"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert f"usage: splitkey {command} " in err and f"splitkey {command}: error: unrecognized arguments: --bogus" in err


def test_console_script_help_runs():
    out = subprocess.run([sys.executable, "-m", "service.cli", "--help"], capture_output=True, text=True, check=True)
    assert "serve" in out.stdout and "loadtest" in out.stdout


def test_client_rejects_a_url_that_is_not_http():
    with pytest.raises(ValueError, match="url must be http"):
        Client("ftp://x")


def test_serve_on_all_interfaces_without_a_key_exits_2_before_starting_anything(capsys):
    assert main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "host '0.0.0.0' is not loopback and no --api-key-file is set" in err and "--insecure" in err


