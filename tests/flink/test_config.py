"""FlinkConfig's execution mode (no job runs: quick)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("pyflink", reason="PyFlink is not installed (make test-flink uses .venv-flink)")

from ratchet._errors import ConfigError  # noqa: E402
from ratchet.flink._config import FlinkConfig  # noqa: E402

pytestmark = pytest.mark.flink


def test_process_mode_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RATCHET_FLINK_EXECUTION_MODE", raising=False)
    conf = FlinkConfig().to_flink()
    assert conf["python.execution-mode"] == "process"
    assert "python.pythonpath" not in conf


def test_thread_mode_puts_the_venvs_site_packages_on_the_embedded_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sysconfig

    monkeypatch.setenv("RATCHET_FLINK_EXECUTION_MODE", "thread")
    conf = FlinkConfig().to_flink()
    assert conf["python.execution-mode"] == "thread"
    paths = conf["python.pythonpath"].split(":")
    assert sysconfig.get_paths()["purelib"] in paths
    # An editable install of ratchet is a `.pth` line the embedded interpreter would not read.
    import ratchet

    assert str(Path(ratchet.__file__).resolve().parent.parent) in paths


def test_an_unknown_mode_is_refused_by_name() -> None:
    with pytest.raises(
        ConfigError, match=r"execution mode 'threads' is not one of process, thread"
    ):
        FlinkConfig(execution_mode="threads").to_flink()
