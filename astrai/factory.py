"""Registry + BaseFactory: the one place where names map to classes.

Models, attention and FFN types, strategies, schedules, callbacks, datasets and
storage formats all register here, so a config can name a component by a string and
a user can add their own with a decorator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

from astrai.errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class _Entry:
    component: type
    category: str
    priority: int


class Registry:
    """Names → classes, with an optional category and priority for listing."""

    def __init__(self, kind: str = "component"):
        self.kind = kind
        self._entries: dict[str, _Entry] = {}

    def register(self, name: str, component_cls: type, category: str = "default", priority: int = 0) -> None:
        if name in self._entries and self._entries[name].component is not component_cls:
            raise ConfigError(f"{self.kind} '{name}' is already registered to {self._entries[name].component.__name__}")
        self._entries[name] = _Entry(component_cls, category, priority)

    def get(self, name: str) -> type:
        try:
            return self._entries[name].component
        except KeyError:
            known = ", ".join(self.list_names()) or "none"
            raise ConfigError(f"unknown {self.kind} '{name}'; known: {known}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def list_names(self, category: str | None = None) -> list[str]:
        entries = [(n, e) for n, e in self._entries.items() if category is None or e.category == category]
        return [n for n, _ in sorted(entries, key=lambda item: (-item[1].priority, item[0]))]


_REGISTRIES: dict[str, Registry] = {}  # kind → its factory's registry


def registered_names(kind: str) -> list[str]:
    """Names registered so far under ``kind`` (e.g. "train_type"), for a layer below the
    factory's own module that must not import it (TrainConfig.validate)."""
    registry = _REGISTRIES.get(kind)
    return registry.list_names() if registry is not None else []


class BaseFactory(Generic[T]):
    """A class-level registry with a ``register`` decorator and ``create``.

    Each subclass gets its own registry (created in ``__init_subclass__``), so
    ``StrategyFactory`` and ``SchedulerFactory`` never see each other's names.
    """

    _registry: Registry
    kind: str = "component"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "_registry" not in cls.__dict__:
            cls._registry = Registry(cls.__dict__.get("kind", cls.kind))
            _REGISTRIES.setdefault(cls._registry.kind, cls._registry)

    @classmethod
    def register(cls, name: str, category: str = "default", priority: int = 0) -> Callable[[type], type]:
        def decorator(component_cls: type) -> type:
            cls._registry.register(name, component_cls, category, priority)
            return component_cls

        return decorator

    @classmethod
    def get(cls, name: str) -> type:
        return cls._registry.get(name)

    @classmethod
    def create(cls, name: str, *args, **kwargs) -> T:
        return cls._registry.get(name)(*args, **kwargs)

    @classmethod
    def list_registered(cls) -> list[str]:
        return cls._registry.list_names()
