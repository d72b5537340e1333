"""The optional C window decoder (packer/images/jpeg_window.py), which pyproject.toml declares only through an
experimental table: built against the system's libjpeg-turbo where its headers are installed, skipped otherwise
(``optional=True``), so that packer installs either way. Everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("packer.images._jpeg_window", ["packer/images/jpeg_window.c"], libraries=["jpeg"],
                             optional=True)])
