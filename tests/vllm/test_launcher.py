"""The replica launcher's command line (no vLLM started): our defaults, and the user's flags win."""

from __future__ import annotations

import json

import pytest

from replica.vllm.launcher import ASYNC_CLS, SYNC_CLS, build_command, effective_config


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_defaults_carry_plugin_prefix_caching_and_kv_events() -> None:
    argv = build_command("/m", ["--max-model-len", "1024"], "tcp://127.0.0.1:5999", python="py")
    assert argv[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(argv, "--model") == "/m" and flag(argv, "--scheduler-cls") == SYNC_CLS
    assert "--enable-prefix-caching" in argv and "--enable-prompt-tokens-details" in argv
    kv = json.loads(flag(argv, "--kv-events-config"))
    assert kv == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:5999",
        "topic": "kv",
    }
    assert argv[-2:] == ["--max-model-len", "1024"]


def test_user_flags_replace_defaults() -> None:
    argv = build_command(
        None, ["--model=/x", "--scheduler-cls=a.B", "--kv-events-config", "{}"], async_scheduling=True
    )
    assert "--model" not in argv and "--scheduler-cls" not in argv and argv.count("--kv-events-config") == 1
    assert argv[-4:] == ["--model=/x", "--scheduler-cls=a.B", "--kv-events-config", "{}"]
    assert flag(build_command("/m", [], async_scheduling=True), "--scheduler-cls") == ASYNC_CLS


def test_effective_config_shows_scheduler_options() -> None:
    cfg = effective_config(
        ["py"], {"KVPICK_CACHE_AWARE_ADMISSION": "1", "KVPICK_AGING_S": "0.5", "HOME": "/"}
    )
    assert cfg["scheduler_options"] == {
        "cache_aware_admission": True,
        "aging_s": 0.5,
    }
    assert cfg["env"] == {"KVPICK_AGING_S": "0.5", "KVPICK_CACHE_AWARE_ADMISSION": "1"}


def test_additional_config_overrides_the_environment() -> None:
    from replica.vllm.options import load_options

    env = {"KVPICK_CACHE_AWARE_ADMISSION": "1", "KVPICK_AGING_S": "3"}
    opts = load_options(env, {"kvpick": {"cache_aware_admission": False}})
    assert (opts.cache_aware_admission, opts.aging_s) == (False, 3.0)
    with pytest.raises(ValueError, match="unknown kvpick options"):
        load_options({}, {"kvpick": {"no_such_option": True}})


def test_a_bad_option_is_a_one_line_error_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from replica.vllm.__main__ import main

    monkeypatch.setenv("KVPICK_AGING_S", "-1")
    assert main(["serve", "/nonexistent-model", "--print-only"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("replica.vllm: bad configuration: aging_s must be >= 0"), err
