"""What pyproject.toml cannot say: the packages, found under their three folders, and the CPU ops.

The CPU ops (the C++ sources in ``kernels/``) are compiled here, at install, once per x86-64 level of
``pagedmodel/kernels/cpu_isa.py``, into extension modules inside ``pagedmodel.kernels``; the loader picks
the level this CPU runs. ``pip install -e .`` builds them in place. Nothing is compiled when a process
starts, so a read-only root or an unwritable home changes nothing.

A level that does not build (no C++ compiler, a compiler too old for AMX) is left out with a warning,
and the package installs all the same: ``cpu_ops_build.json`` beside the modules records what was built
and why the rest was not, and the engine then runs the torch ops in their place and says so once.
"""
from __future__ import annotations

import importlib.util
import json
import platform
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
KERNELS = Path("kernels")                       # relative: setuptools wants relative source paths
MANIFEST = "cpu_ops_build.json"
# the installed name of each folder that holds packages; subpackages are found, not listed
PACKAGE_DIRS = {"pagedmodel": "pagedmodel", "pagedmodel.server": "server", "pagedmodel.operator": "operator"}
# sources that compile to nothing below a level: left out there
NEEDS_LEVEL = {"cpu_amx_linear.cpp": "amx", "cpu_prefill_attention.cpp": "avx512_bf16"}


def discover_packages() -> list[str]:
    packages = []
    for name, folder in PACKAGE_DIRS.items():
        packages += [name] + [f"{name}.{sub}" for sub in find_packages(str(ROOT / folder))]
    return sorted(packages)


def load_isa_module():
    spec = importlib.util.spec_from_file_location("cpu_isa", ROOT / "pagedmodel" / "kernels" / "cpu_isa.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["cpu_isa"] = module          # dataclasses resolves the module's annotations through it
    spec.loader.exec_module(module)
    return module


def cpu_ops_extensions(isa) -> tuple[list, dict]:
    """One CppExtension per level, and the build command that tolerates a level's failure; none without
    torch (an sdist, or metadata alone) or off x86-64."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        print(f"pagedmodel: the CPU ops are x86-64 code; none built on {platform.machine()}", file=sys.stderr)
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as exc:
        print(f"pagedmodel: torch is not importable here ({exc}); the CPU ops are not built", file=sys.stderr)
        return [], {}
    order = [level.name for level in isa.LEVELS]
    sources = sorted((ROOT / KERNELS).glob("*.cpp"))
    extensions = [CppExtension(f"pagedmodel.kernels.{level.extension}", [str(KERNELS / p.name) for p in sources],
                               include_dirs=[str(ROOT / KERNELS)],
                               extra_compile_args=[*isa.COMMON_CFLAGS, *level.cflags])
                  for level in isa.LEVELS]

    def unity_source(level, folder: Path) -> str:
        """One translation unit that includes every source the level needs: the torch headers, most of a
        source's compile time, are parsed once a level instead of once a file (4 levels build in ~80 s of
        CPU time instead of ~5 minutes). The sources keep distinct names for it."""
        folder.mkdir(parents=True, exist_ok=True)
        unity = folder / f"cpu_ops_{level.name}.cpp"
        unity.write_text("".join(f'#include "{path}"\n' for path in sources
                                 if order.index(level.name) >= order.index(NEEDS_LEVEL.get(path.name, order[0]))))
        return str(unity)

    class BuildCpuOps(BuildExtension):
        """Each level in its own temporary folder (the sources are the same, the objects are not); a level
        that fails is reported and left out; ``cpu_ops_build.json`` says what was built."""

        def run(self) -> None:
            self.outcome: dict[str, dict] = {}
            super().run()
            if self.outcome:
                manifest = Path(self.get_ext_fullpath(extensions[0].name)).parent / MANIFEST
                manifest.write_text(json.dumps({"torch": torch.__version__, "levels": self.outcome}, indent=1) + "\n")

        def build_extension(self, ext) -> None:
            level = isa.BY_NAME[ext.name.rsplit("_cpu_ops_", 1)[1]]
            base_temp = self.build_temp
            self.build_temp = str(Path(base_temp) / level.name)
            entry = {"digest": level.sources_digest(ROOT / KERNELS, torch.__version__)}
            try:
                ext.sources = [unity_source(level, Path(self.build_temp))]
                super().build_extension(ext)
                entry["file"] = Path(self.get_ext_fullpath(ext.name)).name
            except Exception as exc:   # noqa: BLE001 - any compiler failure leaves this level out, loudly
                entry["error"] = " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
                print(f"pagedmodel: WARNING: the CPU ops' {level.name} build failed ({entry['error']}); "
                      "engines on CPUs of that level run torch ops instead", file=sys.stderr)
            finally:
                self.build_temp = base_temp
            self.outcome[level.name] = entry

    return extensions, {"build_ext": BuildCpuOps}


isa_module = load_isa_module()
ext_modules, cmdclass = cpu_ops_extensions(isa_module)
# the operator reads its defaults from its copy of the CRD (crds/generate.py writes it)
setup(packages=discover_packages(), package_dir=PACKAGE_DIRS, package_data={"pagedmodel.operator": ["crd.yaml"]},
      ext_modules=ext_modules, cmdclass=cmdclass)
