"""Keeps the daemon process small: pandas is never loaded into it.

pyarrow imports pandas, when it is installed, on the first `pa.array(...)` of a Python list (to
check whether the argument is a pandas object): about 45 MiB of resident memory in a process that
never touches a DataFrame. The daemon refuses the import instead, so pyarrow takes its no-pandas
path. Only the daemon's entry point calls this: analysis and export may use pandas-aware paths.
"""

from __future__ import annotations

import sys


class _NoPandas:
    """A meta-path finder that makes `import pandas` fail as if it were not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "pandas" or name.startswith("pandas."):
            raise ModuleNotFoundError(f"No module named {name!r} (not loaded in the powerprof daemon)", name=name)
        return None


def refuse_pandas() -> bool:
    """Make later `import pandas` fail in this process; False when pandas is already loaded."""
    if "pandas" in sys.modules:
        return False
    if not any(isinstance(f, _NoPandas) for f in sys.meta_path):
        sys.meta_path.insert(0, _NoPandas())
    return True
