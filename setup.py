"""Installs one top-level package, `fastformer` (the drop-in model, data, CLI), with the ops of the
repository's kernels/ folder as its subpackage `fastformer.kernels`: the top-level name `kernels`
belongs to another project on PyPI, which can be installed beside fastformer."""
import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"', (HERE / "fastformer" / "version.py").read_text()).group(1)

setup(
    name="fastformer",
    version=VERSION,
    description="A drop-in, Triton-accelerated version of the classic tutorial Transformer",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["fastformer", "fastformer.*"]) + ["fastformer.kernels"],
    package_dir={"fastformer.kernels": "kernels"},
    package_data={"fastformer.data": ["*.tsv"]},
    python_requires=">=3.10",
    install_requires=[
        "torch",
        "triton; platform_system == 'Linux'",
        "sentencepiece",
        "numpy",
        "tqdm",
        "matplotlib",
    ],
    extras_require={
        "test": ["pytest", "pytest-benchmark", "hypothesis"],
        "bench": ["pytest", "pytest-benchmark"],
    },
    entry_points={"console_scripts": ["fastformer = fastformer.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Operating System :: POSIX :: Linux",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
