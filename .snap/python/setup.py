"""Records, at install time, which libtandem to load: $TANDEM_LIBRARY, else the build tree of the checkout this
package is installed from ($TANDEM_BUILD_DIR, else ../build). Without either, the installed package finds
libtandem at run time through $TANDEM_LIBRARY, the dynamic loader and the install prefixes. Builds the optional C
module _tandem_fastcall (nothing links libtandem: it is loaded at run time)."""

import os
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

SONAME = "libtandem.so.0.2"


def found_library():
    env = os.environ.get("TANDEM_LIBRARY")
    if env:
        return str(Path(env).resolve())
    here = Path(__file__).resolve().parent
    build = os.environ.get("TANDEM_BUILD_DIR")
    for d in ([Path(build)] if build else [here.parent / "build"]):
        for lib in [d / "client" / SONAME, *sorted((d / "client").glob(SONAME + ".*"))]:
            if lib.exists():
                return str(lib.resolve())
    return None


class BuildPy(build_py):
    def run(self):
        super().run()
        target = Path(self.build_lib) / "tandem" / "_install_config.py"
        target.write_text("# Written by setup.py at install time: the libtandem it found.\n"
                          f"LIBRARY = {found_library()!r}\n")


# The hot path's foreign calls (tandem._capi.fastcall): plain C against Python's headers, optional, so an install
# without a compiler still works (through ctypes alone, about 1 us slower per C call).
setup(cmdclass={"build_py": BuildPy},
      ext_modules=[Extension("_tandem_fastcall", ["_tandem_fastcall.c"], optional=True)])
