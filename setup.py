"""Builds the optional native helper ``ems._native`` (see src/ems/_native.c).

Everything else is in pyproject.toml. ``optional=True``: where no C compiler exists
the install still succeeds and ems copies with torch instead.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("ems._native", ["src/ems/_native.c", "src/ems/_native_avx2.c"],
                             optional=True,
                             depends=["src/ems/_checksums.h", "src/ems/xxhash.h"],
                             extra_compile_args=["-O3"])])
