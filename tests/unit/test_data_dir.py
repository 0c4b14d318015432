"""The default ``supervisor.data_dir`` is expanded like an explicit one (defaults are validated)."""

from pathlib import Path

from config import load_settings


def test_default_data_dir_is_expanded_under_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    s = load_settings(None, {}, environ={})
    assert s.supervisor.data_dir == tmp_path / ".local/share/vllm-supervisor"
    assert "~" not in str(s.supervisor.data_dir)


def test_explicit_data_dir_is_expanded_too(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    s = load_settings(None, {"supervisor.data_dir": "~/models"}, environ={})
    assert s.supervisor.data_dir == Path(tmp_path) / "models"
