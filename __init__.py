"""The root of a ringreduce source tree (a clone). The package is the folder ringreduce/ inside it.

Python runs this file only when a clone whose folder is named ``ringreduce`` is itself found by
``import ringreduce``: from the folder that holds the clone (the working directory is on sys.path).
Without this file the clone would be imported as an empty namespace package
(``AttributeError: module 'ringreduce' has no attribute 'all_reduce'``). This file hands the import
over to the installed package (the editable install of this clone, or any other), and when none is
installed it says so and what to do. Under any other name it does nothing: pytest imports it as
the package named after the clone's folder, since the clone's root holds an __init__.py.
"""

import importlib
import importlib.util
import os
import sys


def _installed_package():
    clone = os.path.dirname(os.path.abspath(__file__))
    here = os.path.realpath(os.path.dirname(clone))
    del sys.modules[__name__]  # this file is not the package: look again, without the clone's parent
    saved = list(sys.path)
    sys.path[:] = [p for p in saved if os.path.realpath(p or os.curdir) != here]
    try:
        spec = importlib.util.find_spec(__name__)
        if spec is None or spec.origin is None or os.path.realpath(spec.origin) == os.path.realpath(__file__):
            raise ImportError(
                f"import ringreduce found {clone}, a ringreduce source tree, not the package (its folder "
                f"ringreduce/ is), and no ringreduce is installed for {sys.executable}. Build and install the "
                f"clone with `bash {clone}/scripts/test.sh` (or scripts/bench.sh) and use its Python "
                f"({clone}/.venv/bin/python), or `pip install --no-build-isolation {clone}` into this one; "
                "or run Python from another folder than the clone's parent",
                name=__name__,
            )
        return importlib.import_module(__name__)
    finally:
        sys.path[:] = saved


if __name__ == "ringreduce":
    sys.modules[__name__] = _installed_package()
