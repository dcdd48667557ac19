"""Every public name has a docstring a torch.distributed user can work from.

The public surface is read from the package itself (ringreduce.__all__, ringreduce.functional.__all__,
ringreduce.nn.__all__, the public methods and properties of the public classes), and each callable's
parameters from inspect.signature, so a parameter added later must be documented to pass.
"""

from __future__ import annotations

import inspect
import re
import types

import pytest

import ringreduce

# Classes users get from ringreduce but never construct themselves: their constructors' parameters
# are internal (a Work comes from a collective called with async_op=True).
MADE_BY_RINGREDUCE = {"Work"}


def _public_names() -> list[tuple[str, object]]:
    found: dict[str, object] = {}
    for module in (ringreduce, ringreduce.functional, ringreduce.nn):
        for name in module.__all__:
            obj = getattr(module, name)
            found[f"{module.__name__}.{name}"] = obj
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if attr.startswith("_"):
                        continue
                    if isinstance(member, (staticmethod, classmethod)):
                        member = member.__func__
                    if inspect.isfunction(inspect.unwrap(member)) or isinstance(member, property):
                        found[f"{module.__name__}.{name}.{attr}"] = member
    return sorted(found.items())


PUBLIC = _public_names()


def _parameters(name: str, obj: object) -> list[str]:
    if isinstance(obj, (types.ModuleType, property)) or (inspect.isclass(obj) and issubclass(obj, int)):
        return []  # modules, properties and enums take no arguments
    if inspect.isclass(obj):
        if obj.__name__ in MADE_BY_RINGREDUCE:
            return []
        obj = obj.__init__
    params = inspect.signature(obj).parameters
    return [p for p in params if p not in ("self", "cls")]


def test_the_public_surface_is_what_the_contract_names() -> None:
    names = {name for name, _ in PUBLIC}
    for expected in ("ringreduce.all_reduce_avg", "ringreduce.Work.wait", "ringreduce.GradientAverager.no_sync",
                     "ringreduce.build_info", "ringreduce.ReduceOp", "ringreduce.functional.all_reduce",
                     "ringreduce.nn.all_gather"):
        assert expected in names


@pytest.mark.parametrize("name,obj", PUBLIC, ids=[name for name, _ in PUBLIC])
def test_docstring_names_every_parameter(name: str, obj: object) -> None:
    doc = inspect.getdoc(obj)
    assert doc and len(doc.split()) >= 8, f"{name} has no docstring worth the name: {doc!r}"
    missing = [p for p in _parameters(name, obj) if not re.search(rf"(?<![\w.]){re.escape(p)}(?!\w)", doc)]
    assert not missing, f"{name}'s docstring does not describe its parameter(s) {missing}"


@pytest.mark.parametrize("name", ["ringreduce.all_reduce", "ringreduce.all_reduce_avg",
                                  "ringreduce.all_reduce_coalesced", "ringreduce.all_gather",
                                  "ringreduce.reduce_scatter"])
def test_collectives_document_returns_errors_and_streams(name: str) -> None:
    doc = inspect.getdoc(dict(PUBLIC)[name])
    for section in ("Args:", "Returns:", "Raises:"):
        assert section in doc, f"{name}: no {section} section"
    for error in ("TypeError", "ValueError", "RuntimeError", "DistBackendError"):
        assert error in doc, f"{name}: does not say when it raises {error}"
    assert "stream" in doc, f"{name}: does not say which CUDA stream the call runs on"


def test_algorithm_is_described() -> None:
    for fn in (ringreduce.all_reduce, ringreduce.all_reduce_avg):
        doc = inspect.getdoc(fn)
        assert all(word in doc for word in ('"auto"', '"ring"', '"hierarchical"')), fn.__name__
