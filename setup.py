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
    license="BSD-3-Clause",
    packages=[*find_packages(include=["fastformer", "fastformer.*"]), "fastformer.kernels"],
    package_dir={"fastformer.kernels": "kernels"},
    # kernels/tuned/: the tables a GPU's sweep decided (kernels/_tuned.py), read on that GPU model
    package_data={"fastformer.data": ["*.tsv"], "fastformer.kernels": ["tuned/*.json"]},
    python_requires=">=3.10",
    # The versions CI tests: the oldest lane's torch 2.11 + Triton 3.6 to the newest's torch 2.13 +
    # Triton 3.9 (.ci/run; tests/test_install.py holds these bounds, .ci/run and the README to one
    # another). Unbounded, pip would resolve a torch release that no test has run on.
    install_requires=[
        "torch>=2.11,<2.14",
        "triton>=3.6,<3.10; platform_system == 'Linux'",
        "sentencepiece",
        "numpy",
        "tqdm",
        "matplotlib",
    ],
    extras_require={
        # mkdocs: tests/test_docs.py builds the manual (docs/) as CI does
        # ruff pinned: a new release's rules or style would fail CI on code that did not change
        # setuptools >= 70.1 builds an editable install without build isolation, as tools/gpu_run.sh
        # does offline on a GPU machine (tests/test_gpu_run.py rehearses it); older ones need `wheel`
        "test": [
            "pytest",
            "pytest-benchmark",
            "hypothesis",
            "mkdocs",
            "mkdocs-material",
            "ruff==0.17.6",
            "setuptools>=70.1",
            # torchao: tests/test_module_semantics.py quantizes the model with it (a wheel, no dependencies)
            "torchao>=0.18,<0.19",
            # tests/test_export.py exports the model to ONNX and runs it back (torch.onnx's dynamo exporter
            # needs onnxscript); bounded, as torchao, to the releases the tests have run on
            "onnx>=1.23,<1.24",
            "onnxscript>=0.7,<0.8",
            "onnxruntime>=1.32,<1.33",
        ],
        "bench": ["pytest", "pytest-benchmark"],
        "docs": ["mkdocs", "mkdocs-material"],
    },
    entry_points={"console_scripts": ["fastformer = fastformer.cli:main"]},
    classifiers=[
        "License :: OSI Approved :: BSD License",
        "Programming Language :: Python :: 3",
        "Operating System :: POSIX :: Linux",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
