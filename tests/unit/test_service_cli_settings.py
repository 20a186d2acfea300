"""One configuration: every setting is a flag and a SPLITKEY_* variable, made from the settings
object, documented in one generated table (service.cli_settings)."""

from __future__ import annotations

import os
import pathlib
import re

import pytest
from pydantic import ValidationError

from service import cli_settings
from service.cli import build_parser
from service.cli_settings import env_var, flag
from service.core.settings import GROUPS, ServiceSettings

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIELDS = ServiceSettings.model_fields

#: A valid value, other than the default, for every setting (as the command line gives it).
EXAMPLES = {
    "host": "127.0.0.2", "port": "8123", "ray_address": "auto", "ray_namespace": "ns", "api_key_file": "/k", "api_key_group_readable": "true",
    "max_body_bytes": "4096", "max_inflight": "3", "max_inflight_bytes": "8192", "body_timeout_s": "7.5",
    "min_body_rate": "100", "body_grace_s": "2", "request_timeout_s": "9", "retry_after_s": "4",
    "shutdown_grace_s": "5", "workers": "3", "device": "gpu", "worker_cpus": "0.5", "worker_memory_bytes": "1024",
    "worker_concurrency": "8", "kernel_threads": "2", "block_size": "128", "batch_rows": "16",
    "gpu_kernels": "fused", "cpu_kernels": "fused", "heal_interval_s": "1", "shards": "4", "min_shard_keys": "8",
    "merge_fanin": "4",
    "remote_merge_bytes": "0", "context_shard_keys": "32", "max_replicas": "2", "persist_dir": "/p",
    "grpc_port": "8001", "record_cache": "16", "worker_channel": "false", "write_timeout_s": "2.5",
    "metrics_port": "9100", "metrics_host": "0.0.0.0", "log_format": "json", "log_level": "debug",
    "max_connections": "100", "max_client_connections": "10", "tombstone_horizon_s": "60",
}


def test_every_setting_is_in_exactly_one_group_and_has_a_description():
    grouped = [name for names in GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(FIELDS) and len(grouped) == len(set(grouped))
    assert all(FIELDS[name].description for name in FIELDS)


def test_every_setting_has_a_flag_that_sets_it():
    assert set(EXAMPLES) == set(FIELDS)  # a new setting needs an example here
    argv = ["serve"] + [arg for name, value in EXAMPLES.items() for arg in (flag(name), value)]
    settings = ServiceSettings(**cli_settings.given(build_parser().parse_args(argv)))
    assert settings == ServiceSettings(**EXAMPLES)  # each flag set its own field, parsed by the model
    assert all(getattr(settings, name) != info.default for name, info in FIELDS.items())


def test_flags_win_over_variables_and_variables_fill_the_rest(monkeypatch):
    monkeypatch.setenv("SPLITKEY_MAX_INFLIGHT", "7")
    monkeypatch.setenv("SPLITKEY_REQUEST_TIMEOUT_S", "11")
    args = build_parser().parse_args(["serve", "--max-inflight", "3"])
    settings = ServiceSettings(**cli_settings.given(args))
    assert (settings.max_inflight, settings.request_timeout_s) == (3, 11.0)


def test_flag_names_drop_the_seconds_suffix_and_variables_keep_the_field_name():
    assert flag("request_timeout_s") == "--request-timeout" and env_var("request_timeout_s") == "SPLITKEY_REQUEST_TIMEOUT_S"
    assert flag("max_body_bytes") == "--max-body-bytes"


@pytest.mark.parametrize("argv, expected", [
    (["--max-inflight", "0"], ("--max-inflight (SPLITKEY_MAX_INFLIGHT): Input should be greater than or equal to 1, "
                               "got '0'")),
    (["--body-timeout", "soon"], "--body-timeout (SPLITKEY_BODY_TIMEOUT_S): Input should be a valid number"),
    (["--port", "70000"], "--port (SPLITKEY_PORT): Input should be less than or equal to 65535, got '70000'"),
    (["--max-body-bytes", "4096", "--max-inflight-bytes", "2048"],
     "--max-inflight-bytes (SPLITKEY_MAX_INFLIGHT_BYTES) must be at least --max-body-bytes (SPLITKEY_MAX_BODY_BYTES, "
     "4096), got 2048"),
    (["--ray-address", " "], "--ray-address (SPLITKEY_RAY_ADDRESS): must be 'auto' or HOST:PORT, not blank, "
                             "got ' '"),
])
def test_a_bad_value_is_explained_by_flag_variable_and_value(argv, expected):
    with pytest.raises(ValidationError) as err:
        ServiceSettings(**cli_settings.given(build_parser().parse_args(["serve", *argv])))
    assert expected in cli_settings.explain(err.value)


@pytest.mark.parametrize("cpus, ok", [("0.00001", False), ("1.00005", False), ("inf", False), ("nan", False),
                                      ("0.0001", True), ("0.25", True), ("1.0001", True), ("3", True)])
def test_worker_cpus_finer_than_rays_step_are_refused_before_ray_starts(cpus, ok):
    args = cli_settings.given(build_parser().parse_args(["serve", "--worker-cpus", cpus]))
    if ok:
        assert ServiceSettings(**args).worker_cpus == float(cpus)
        return
    with pytest.raises(ValidationError) as err:
        ServiceSettings(**args)
    assert "--worker-cpus (SPLITKEY_WORKER_CPUS): " in (text := cli_settings.explain(err.value)), text
    assert f"got {cpus!r}" in text


def test_a_persist_dir_that_cannot_be_a_folder_is_refused_naming_the_flag(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    for bad in (afile, afile / "below"):
        with pytest.raises(ValidationError) as err:
            ServiceSettings(**cli_settings.given(build_parser().parse_args(["serve", "--persist-dir", str(bad)])))
        text = cli_settings.explain(err.value)
        assert text.startswith("--persist-dir (SPLITKEY_PERSIST_DIR): must be a folder") and str(afile) in text, text
    # a folder, or a path whose first existing ancestor is a folder (the workers make the rest)
    for good in (tmp_path, tmp_path / "new" / "deeper"):
        assert ServiceSettings(persist_dir=good).persist_dir == good


def test_a_bad_choice_is_refused_by_the_parser_with_the_choices(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--device", "tpu"])
    err = capsys.readouterr().err
    assert "argument --device: invalid choice: 'tpu'" in err and all(c in err for c in ("auto", "cpu", "gpu"))


def test_the_documented_table_is_the_generated_one():
    doc = (ROOT / "docs" / "API.md").read_text()
    assert cli_settings.markdown_table() in doc, "regenerate with: python -m service.cli_settings"


def test_serve_help_lists_every_flag_under_its_group(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    for group, names in GROUPS.items():
        assert f"\n{group}:\n" in out
        assert all(flag(name) in out and env_var(name) in out for name in names)


FLOAT_SETTINGS = sorted(name for name, f in FIELDS.items() if f.annotation is float)


@pytest.mark.parametrize("name", FLOAT_SETTINGS)
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "Infinity"])
def test_every_float_setting_refuses_infinity_and_nan_before_anything_starts(name, value):
    # `--request-timeout inf` used to start a server whose context queries then all failed on the workers.
    args = cli_settings.given(build_parser().parse_args(["serve", f"{flag(name)}={value}"]))
    with pytest.raises(ValidationError) as err:
        ServiceSettings(**args)
    text = cli_settings.explain(err.value)
    assert text.startswith(f"{flag(name)} ({env_var(name)}): ") and f"got {value!r}" in text, text


def test_the_float_settings_are_the_timeouts_rates_and_cpu_share():
    assert FLOAT_SETTINGS == ["body_grace_s", "body_timeout_s", "heal_interval_s", "min_body_rate",
                              "request_timeout_s", "shutdown_grace_s", "tombstone_horizon_s", "worker_cpus",
                              "write_timeout_s"]


def write(tmp_path: pathlib.Path, text: str) -> pathlib.Path:
    path = tmp_path / "splitkey.toml"
    path.write_text(text)
    return path


def test_a_config_file_gives_every_setting_by_its_name(tmp_path):
    path = write(tmp_path, "".join(f'{name} = "{value}"\n' for name, value in EXAMPLES.items()))
    assert ServiceSettings(**cli_settings.from_file(path)) == ServiceSettings(**EXAMPLES)
    typed = write(tmp_path, 'max-inflight = 3\nworker_channel = false\nbody-timeout = 7.5\nhost = "::1"\n')
    assert ServiceSettings(**cli_settings.from_file(typed)) == ServiceSettings(
        max_inflight=3, worker_channel=False, body_timeout_s=7.5, host="::1")


def test_flags_win_over_variables_which_win_over_the_file_which_wins_over_defaults(tmp_path, monkeypatch):
    path = write(tmp_path, 'max_inflight = 5\nrequest-timeout = 30.5\nretry_after_s = 7\nmin_shard_keys = 64\n')
    monkeypatch.setenv("SPLITKEY_REQUEST_TIMEOUT_S", "11")
    monkeypatch.setenv("splitkey_retry_after_s", "2")  # pydantic-settings reads variables case-insensitively
    monkeypatch.setenv("SPLITKEY_MIN_SHARD_KEYS", "128")
    args = build_parser().parse_args(["serve", "--config", str(path), "--min-shard-keys", "256"])
    settings = ServiceSettings(**cli_settings.layered(args, os.environ))
    assert (settings.max_inflight, settings.request_timeout_s, settings.retry_after_s, settings.min_shard_keys,
            settings.merge_fanin) == (5, 11.0, 2, 256, FIELDS["merge_fanin"].default)


@pytest.mark.parametrize("text, message", [
    ("max_inflite = 3\n", "key must be a setting of splitkey serve, got 'max_inflite': did you mean max_inflight?"),
    ("colour = 'red'\n", "key must be a setting of splitkey serve, got 'colour' (docs/API.md section 9 lists them)"),
    ("[network]\nport = 1\n", "network must be a value at the top level, got a table"),
    ("max_inflight = 3\nmax-inflight = 4\n", "max-inflight must be given once, got it under two names"),
    ("port = \n", "must be a TOML file: "),
])
def test_a_config_file_with_a_key_that_is_no_setting_is_refused_naming_it(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match=re.escape(f"--config {str(path)!r}") + ".*" + re.escape(message)):
        cli_settings.from_file(path)


def test_serve_with_a_bad_config_file_exits_2_before_starting_anything(tmp_path, capsys):
    from service.cli import main

    assert main(["serve", "--config", str(write(tmp_path, "prot = 9000\n"))]) == 2
    assert "got 'prot': did you mean port?" in capsys.readouterr().err
    assert main(["serve", "--config", str(write(tmp_path, "max_inflight = 0\n"))]) == 2
    assert "--max-inflight (SPLITKEY_MAX_INFLIGHT): Input should be greater than or equal to 1, got 0" in \
        capsys.readouterr().err
    assert main(["serve", "--config", str(tmp_path / "missing.toml")]) == 2
    assert (f"--config must be a readable TOML file, got '{tmp_path / 'missing.toml'}': No such file or directory"
            in capsys.readouterr().err)
