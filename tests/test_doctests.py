"""Every docstring example in the packages runs and prints what it says."""

import doctest
import importlib
import pkgutil

import pytest

PACKAGES = ["topology", "emu", "placement", "pipesched", "flowsched", "netweave"]


def modules():
    for name in PACKAGES:
        pkg = importlib.import_module(name)
        yield name
        for info in pkgutil.walk_packages(pkg.__path__, prefix=f"{name}."):
            if info.name.endswith("__main__"):
                continue
            yield info.name


@pytest.mark.parametrize("name", sorted(set(modules())))
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
