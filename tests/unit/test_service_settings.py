import pytest
from pydantic import ValidationError

from service.core.settings import ServiceSettings


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
    f.chmod(0o600)
    assert ServiceSettings(api_key_file=f).api_key() == "abc123"
    f.write_text("\n")
    with pytest.raises(ValueError) as err:
        ServiceSettings(api_key_file=f).api_key()
    assert str(err.value) == f"--api-key-file (SPLITKEY_API_KEY_FILE) '{f}' must hold a non-empty token, got an empty file"
    f.write_text("abc123")
    f.chmod(0o644)
    with pytest.raises(ValueError) as err:
        ServiceSettings(api_key_file=f).api_key()
    assert str(err.value) == (f"--api-key-file (SPLITKEY_API_KEY_FILE) '{f}' must not be readable by every user, "
                              "got mode 0644: chmod 600 it")


@pytest.mark.parametrize("mode", [0o602, 0o620, 0o622])
def test_an_api_key_file_others_could_rewrite_is_refused(tmp_path, mode):
    f = tmp_path / "key"
    f.write_text("abc123")
    f.chmod(mode)
    with pytest.raises(ValueError, match=f"must not be writable by other users \\(they could replace the key\\), "
                                         f"got mode 0{mode:o}: chmod 600 it"):
        ServiceSettings(api_key_file=f).api_key()


def test_a_group_readable_api_key_file_when_allowed_is_read_only_for_a_group_of_this_process(tmp_path):
    import os

    f = tmp_path / "key"
    f.write_text("abc123")
    f.chmod(0o440)  # as Kubernetes mounts a secret for the pod's fsGroup
    allowed = ServiceSettings(api_key_file=f, api_key_group_readable=True)
    assert allowed.api_key() == "abc123"  # the file's group is this process's
    foreign = max({os.getgid(), *os.getgroups()}) + 4242
    try:
        os.chown(f, -1, foreign)
    except PermissionError:
        pytest.skip("changing a file's group needs root here")
    with pytest.raises(ValueError, match=f"must not be readable by a group this process is not in, got mode 0440 "
                                         f"and group {foreign}: chmod 600 it"):
        allowed.api_key()


@pytest.mark.parametrize("blank", ["", "  "])
def test_a_blank_api_key_file_is_refused_not_read_as_the_current_directory(blank, monkeypatch):
    with pytest.raises(ValidationError, match="must be the path of a file holding the token, not blank"):
        ServiceSettings(api_key_file=blank)
    monkeypatch.setenv("SPLITKEY_API_KEY_FILE", blank)
    with pytest.raises(ValidationError, match="not blank"):
        ServiceSettings()


def test_a_misspelt_variable_is_named_with_the_setting_it_is_close_to():
    from service.cli_settings import misspelt

    env = {"SPLITKEY_WORKERZ": "3", "SPLITKEY_MAX_INFLIGT": "5", "SPLITKEY_WORKERS": "2",
           "SPLITKEY_IMAGE": "splitkey:dev", "SPLITKEY_CLUSTER_DIR": "/tmp/c", "PATH": "/bin"}
    assert misspelt(env) == ["SPLITKEY_MAX_INFLIGT is not a setting and is ignored: did you mean SPLITKEY_MAX_INFLIGHT?",
                             "SPLITKEY_WORKERZ is not a setting and is ignored: did you mean SPLITKEY_WORKERS?"]


@pytest.mark.parametrize("blank", ["", "  "])
def test_a_blank_persist_dir_or_namespace_is_refused_not_taken_as_the_current_directory(blank, monkeypatch):
    with pytest.raises(ValidationError, match="must be the path of a folder, not blank"):
        ServiceSettings(persist_dir=blank)
    monkeypatch.setenv("SPLITKEY_PERSIST_DIR", blank)  # an empty ConfigMap value
    with pytest.raises(ValidationError, match="not blank"):
        ServiceSettings()
    monkeypatch.delenv("SPLITKEY_PERSIST_DIR")
    with pytest.raises(ValidationError, match="must name a Ray namespace, not blank"):
        ServiceSettings(ray_namespace=blank)


@pytest.mark.parametrize("field", ["host", "metrics_host"])
@pytest.mark.parametrize("value", ["not a host!", "", "a..b", "-x.org", "x/y"])
def test_a_host_that_is_no_address_or_host_name_is_a_bad_setting(field, value):
    with pytest.raises(ValidationError, match="must be an IP address or a host name"):
        ServiceSettings(**{field: value})


@pytest.mark.parametrize("ports, message", [
    ({"port": 9000, "grpc_port": 9000}, "--grpc-port (SPLITKEY_GRPC_PORT) must differ from --port (SPLITKEY_PORT), "
                                        "got 9000 for both"),
    ({"port": 9000, "metrics_port": 9000}, "--metrics-port (SPLITKEY_METRICS_PORT) must differ from --port"),
    ({"grpc_port": 9001, "metrics_port": 9001}, "--metrics-port (SPLITKEY_METRICS_PORT) must differ from --grpc-port"),
    ({"port": 9000, "metrics_port": 9000, "metrics_host": "0.0.0.0"}, "must differ from --port"),
])
def test_two_listeners_on_one_port_are_refused(ports, message):
    with pytest.raises(ValidationError) as err:
        ServiceSettings(**ports)
    assert message in str(err.value)


def test_listeners_may_share_a_port_number_on_other_addresses_or_any_free_port():
    assert ServiceSettings(port=9000, metrics_port=9000, metrics_host="127.0.0.2").metrics_port == 9000
    assert ServiceSettings(port=0, grpc_port=0, metrics_port=0).grpc_port == 0

@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.53", "::1", "[::1]", "localhost"])
def test_loopback_hosts_need_no_key(host):
    assert ServiceSettings(host=host).check_exposure(insecure=False) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "example.org"])
def test_a_reachable_host_without_a_key_is_refused_unless_insecure(host, tmp_path):
    with pytest.raises(ValueError, match=f"host {host!r} is not loopback and no --api-key-file is set"):
        ServiceSettings(host=host).check_exposure(insecure=False)
    assert "INSECURE: listening on" in ServiceSettings(host=host, port=9).check_exposure(insecure=True)
    key = tmp_path / "key"
    key.write_text("secret")
    assert ServiceSettings(host=host, api_key_file=key).check_exposure(insecure=False) is None


def test_a_key_file_every_user_can_read_is_refused(tmp_path):
    f = tmp_path / "key"
    f.write_text("abc123")
    f.chmod(0o644)
    with pytest.raises(ValueError, match=r"api-key-file \(SPLITKEY_API_KEY_FILE\) '.*' must not be readable by every user, "
                                         r"got mode 0644: chmod 600"):
        ServiceSettings(api_key_file=f).api_key()


def test_a_key_file_its_group_can_read_is_refused_unless_allowed(tmp_path):
    f = tmp_path / "key"
    f.write_text("abc123")
    f.chmod(0o640)
    with pytest.raises(ValueError, match=r"api-key-file \(SPLITKEY_API_KEY_FILE\) '.*' must not be readable by its group, "
                                         r"got mode 0640: chmod 600 it \(a Kubernetes Secret"):
        ServiceSettings(api_key_file=f).api_key()
    # A Kubernetes Secret with fsGroup (0440, the pod's group): the deployment says so.
    assert ServiceSettings(api_key_file=f, api_key_group_readable=True).api_key() == "abc123"
    f.chmod(0o600)
    assert ServiceSettings(api_key_file=f).api_key() == "abc123"


def test_a_key_file_in_a_folder_every_user_may_write_to_is_refused_unless_sticky(tmp_path):
    folder = tmp_path / "open"
    folder.mkdir()
    f = folder / "key"
    f.write_text("abc123")
    f.chmod(0o600)
    folder.chmod(0o777)
    with pytest.raises(ValueError, match=r"must be in a folder other users cannot write to \(they could replace the "
                                         r"key\), got '.*open' with mode 0777: chmod o-w it"):
        ServiceSettings(api_key_file=f).api_key()
    folder.chmod(0o1777)  # sticky, as /tmp: only the owner may replace it
    assert ServiceSettings(api_key_file=f).api_key() == "abc123"
    link = tmp_path / "link"  # a symlink elsewhere: the folder of the file it names counts
    link.symlink_to(f)
    folder.chmod(0o777)
    with pytest.raises(ValueError, match="must be in a folder other users cannot write to"):
        ServiceSettings(api_key_file=link).api_key()


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_an_api_key_file_that_is_not_a_file_is_named_with_its_flag(tmp_path, kind):
    path = tmp_path / "key"
    if kind == "directory":
        path.mkdir()
    with pytest.raises(ValueError, match=r"--api-key-file \(SPLITKEY_API_KEY_FILE\) '.*key' must be a readable file "
                                         r"holding the token, got " + ("a directory" if kind == "directory" else "no such file")):
        ServiceSettings(api_key_file=path).api_key()


def test_the_body_budget_must_hold_at_least_one_largest_body():
    with pytest.raises(ValueError, match=r"--max-inflight-bytes \(SPLITKEY_MAX_INFLIGHT_BYTES\) must be at least"):
        ServiceSettings(max_body_bytes=2**20, max_inflight_bytes=2**19)
    s = ServiceSettings(max_body_bytes=2**20, max_inflight_bytes=2**20, body_timeout_s=5, min_body_rate=0,
                        body_grace_s=1)
    assert (s.pace().timeout_s, s.pace().min_rate, s.pace().grace_s) == (5, 0, 1)
