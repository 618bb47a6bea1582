"""The library's type annotations evaluate: jaxtyping shape specs are strings ("...", "*b t d"),
and a lint fix that turns one into something else breaks only whoever resolves the hints."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import typing

import pdecomp


def test_every_annotation_in_pdecomp_evaluates() -> None:
    checked, broken = 0, []
    for info in pkgutil.walk_packages(pdecomp.__path__, "pdecomp."):
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            members = [v for v in vars(obj).values() if inspect.isfunction(v)] \
                if inspect.isclass(obj) else []
            for f in [obj, *members]:
                if not (inspect.isfunction(f) or inspect.isclass(f)):
                    continue
                checked += 1
                try:
                    typing.get_type_hints(f)
                except NameError:  # a third-party alias's own forward reference (optax)
                    pass
                except Exception as e:  # noqa: BLE001
                    broken.append(f"{module.__name__}.{f.__qualname__}: {e!r}")
    assert checked > 300 and broken == [], broken
