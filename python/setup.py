"""Copies the workspace's built libsluice_writer.so and sluice-cufile-probe into the package
(sluice_ckpt/lib/) when it is built, so `pip install ./python` gives a self-contained package.

Where they come from, first found: $SLUICE_WRITER_LIB_DIR; the workspace's target/release; its
target/debug. Build them first with `cargo build --release -p sluice-writer`. Without either the
package still installs, and finds the library at run time through $SLUICE_WRITER_LIB.
"""

import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

try:  # setuptools >= 70.1 has its own; older ones take the wheel package's
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:
    from wheel.bdist_wheel import bdist_wheel

HERE = Path(__file__).resolve().parent
FILES = ("libsluice_writer.so", "sluice-cufile-probe")


def built_dir():
    candidates = []
    if os.environ.get("SLUICE_WRITER_LIB_DIR"):
        candidates.append(Path(os.environ["SLUICE_WRITER_LIB_DIR"]))
    candidates += [HERE.parent / "target" / "release", HERE.parent / "target" / "debug"]
    for d in candidates:
        if all((d / f).is_file() for f in FILES):
            return d
    return None


class BuildPyWithLibrary(build_py):
    def run(self):
        super().run()
        src = built_dir()
        dest = Path(self.build_lib) / "sluice_ckpt" / "lib"
        if src is None:
            print(
                "sluice-ckpt: no built libsluice_writer.so found (cargo build --release -p "
                "sluice-writer, or SLUICE_WRITER_LIB_DIR); set SLUICE_WRITER_LIB at run time"
            )
            return
        dest.mkdir(parents=True, exist_ok=True)
        for f in FILES:
            shutil.copy2(src / f, dest / f)
        print(f"sluice-ckpt: bundled {', '.join(FILES)} from {src}")


class PlatformWheel(bdist_wheel):
    """The wheel carries a native library for this platform (loaded with ctypes, not a Python
    extension): tagged py3-none-<platform>, so pip installs it on any Python 3 of this platform
    and on no other."""

    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        return "py3", "none", super().get_tag()[2]


setup(cmdclass={"build_py": BuildPyWithLibrary, "bdist_wheel": PlatformWheel})
