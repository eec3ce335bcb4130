"""The kopf operator, installed as ``pagedmodel.operator``.

From the repository root (on ``sys.path`` for ``python3 -m pip``, ``python3 -m pytest``, ``python3 -m venv``)
this folder is also found as the top-level ``operator``, ahead of the standard library's. A Python whose
startup imported ``collections`` already (through some ``.pth`` file) never looks again, but a fresh venv
does, and then died at start: ``cannot import name 'eq' from 'operator'``. Imported under that name, this
module puts the standard library's ``operator`` in its place. Only modules that Python's startup has
already loaded are touched before that module is whole.
"""
if __name__ == "operator":
    import os
    import sys

    _path = os.path.join(os.path.dirname(os.__file__), "operator.py")
    _stdlib = type(sys)("operator")
    _stdlib.__file__ = _path
    sys.modules["operator"] = _stdlib   # what `import operator` returns once this file has run
    with open(_path, encoding="utf-8") as _source:
        exec(compile(_source.read(), _path, "exec"), _stdlib.__dict__)   # noqa: S102 - the stdlib's own source
    # the spec from the import system's own frozen modules: importing importlib.util here would import
    # collections again, which may be what is importing this file
    _bootstrap, _external = sys.modules["_frozen_importlib"], sys.modules["_frozen_importlib_external"]
    _stdlib.__spec__ = _bootstrap.ModuleSpec("operator", _external.SourceFileLoader("operator", _path), origin=_path)
    _stdlib.__spec__.has_location = True
