"""Configuration: options by key, read by actions (`ctx.config`) and injected tool arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ConfigOption:
    """A typed option with a default."""

    key: str
    config_type: type = str
    default: Any = None

    def get_key(self) -> str:
        return self.key

    def get_default_value(self) -> Any:
        return self.default


class Configuration:
    """Options by key; `get` takes a `ConfigOption` (its default when unset) or a key."""

    def __init__(self, conf_data: dict[str, Any] | None = None) -> None:
        self.conf_data: dict[str, Any] = dict(conf_data or {})

    def get(self, option: ConfigOption | str, default: Any = None) -> Any:
        if isinstance(option, ConfigOption):
            return self.conf_data.get(option.key, option.default)
        return self.conf_data.get(option, default)

    def set(self, option: ConfigOption | str, value: Any) -> Configuration:
        key = option.key if isinstance(option, ConfigOption) else option
        self.conf_data[key] = value
        return self

    def _typed(self, key: str, default: Any, kind: type) -> Any:
        value = self.conf_data.get(key, default)
        return value if value is None else kind(value)

    def get_str(self, key: str, default: str | None = None) -> Any:
        return self._typed(key, default, str)

    def get_int(self, key: str, default: int | None = None) -> Any:
        return self._typed(key, default, int)

    def get_float(self, key: str, default: float | None = None) -> Any:
        return self._typed(key, default, float)

    def get_bool(self, key: str, default: bool | None = None) -> Any:
        return self._typed(key, default, bool)

    def set_str(self, key: str, value: str) -> None:
        self.conf_data[key] = value

    def set_int(self, key: str, value: int) -> None:
        self.conf_data[key] = value

    def set_float(self, key: str, value: float) -> None:
        self.conf_data[key] = value

    def set_bool(self, key: str, value: bool) -> None:
        self.conf_data[key] = value

    def load_from_file(self, path: str) -> None:
        """Options from a YAML file: a mapping (an `agent:` section is read if present)."""
        try:
            import yaml  # type: ignore[import-untyped]
        except ImportError as exc:
            raise ValueError(
                f"reading the configuration file {path} needs PyYAML (pip install pyyaml); or "
                f"set the options with config.set(...)"
            ) from exc
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
        if not isinstance(data, dict):
            raise ValueError(f"configuration file {path}: expected a mapping of options")
        section = data.get("agent", data)
        self.conf_data.update(section if isinstance(section, dict) else {})


ReadableConfiguration = Configuration
WritableConfiguration = Configuration
