"""Build hook of the RoutePack binding: copies libroutepack (built by CMake beforehand) into
the package and records where the source tree is, so an installed copy finds a library."""

import os
import shutil
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def find_library():
    """$ROUTEPACK_LIBRARY, else $ROUTEPACK_BUILD_DIR/core, else the repository's build/core."""
    env = os.environ.get("ROUTEPACK_LIBRARY")
    if env:
        return Path(env)
    build = os.environ.get("ROUTEPACK_BUILD_DIR")
    build = Path(build) if build else REPO / "build"
    if not build.is_absolute():
        build = REPO / build
    return build / "core" / "libroutepack.so"


class BuildPy(build_py):
    def run(self):
        super().run()
        pkg = Path(self.build_lib) / "routepack"
        lib = find_library()
        if lib.exists():
            shutil.copyfile(lib.resolve(), pkg / "libroutepack.so")
            print("routepack: bundled %s" % lib.resolve(), file=sys.stderr)
        else:
            print("routepack: %s not found (build the library with CMake first); the "
                  "package will look for libroutepack at run time" % lib, file=sys.stderr)
        src = str(REPO) if (REPO / "core" / "include" / "routepack").is_dir() else ""
        (pkg / "_build_info.py").write_text(
            '"""Written at install time by setup.py."""\nSOURCE_DIR = %r\n' % src)


class BinaryDistribution(Distribution):
    """A wheel that bundles libroutepack is for this platform only."""

    def has_ext_modules(self):
        return find_library().exists()


setup(cmdclass={"build_py": BuildPy}, distclass=BinaryDistribution)
