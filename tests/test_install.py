"""fastformer installs one top-level package: its ops are `fastformer.kernels`, never a top-level
`kernels`, which is another project's name on PyPI (the kernel-hub client used with Hugging Face
transformers). Installed side by side in one environment, each keeps its own files.

The install test needs the package index (pip downloads `kernels`, its dependencies and
setuptools), so it is marked `network` and deselected by default: `pytest -m network`.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import fastformer

REPO = Path(__file__).resolve().parent.parent


def test_the_ops_import_as_fastformer_kernels_only():
    """Installed in editable mode (the README's first command), the checkout's kernels/ folder is
    `fastformer.kernels`, and nothing of fastformer's imports a top-level `kernels`."""
    from fastformer import kernels

    assert kernels.__name__ == "fastformer.kernels"
    assert Path(kernels.__file__).resolve() == REPO / "kernels" / "__init__.py"
    assert "kernels" not in sys.modules or not Path(sys.modules["kernels"].__file__).resolve().is_relative_to(REPO)


def _copy_of_fastformer(tmp_path):
    """A second copy of the package, fastformer/ alone, as in another checkout."""
    shutil.copytree(REPO / "fastformer", tmp_path / "fastformer", ignore=shutil.ignore_patterns("__pycache__"))


def test_a_checkout_never_runs_with_another_copys_ops(tmp_path):
    """Python running a checkout's fastformer/ while another copy is installed in editable mode
    (whose finder maps fastformer.kernels to that copy's kernels/, as setuptools' does): the ops
    refuse to load, naming both copies, rather than mix one copy's code with the other's kernels."""
    _copy_of_fastformer(tmp_path)
    script = f"""
import importlib.util, sys
class EditableFinder:  # the finder an editable install of the other copy appends
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname == "fastformer.kernels":
            return importlib.util.spec_from_file_location(
                fullname, {str(REPO / "kernels" / "__init__.py")!r},
                submodule_search_locations=[{str(REPO / "kernels")!r}],
            )
sys.meta_path.append(EditableFinder)
from fastformer import kernels
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("ImportError: fastformer is imported from"), result.stderr[-3000:]
    assert str(tmp_path / "fastformer") in message and str(REPO / "kernels") in message


def test_an_uninstalled_checkout_says_to_install_it(tmp_path):
    """Without an install (`python -S`: no site-packages, so no editable finder) `fastformer.kernels`
    does not exist, and `from fastformer import kernels` says what to run."""
    _copy_of_fastformer(tmp_path)
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-S", "-c", "from fastformer import kernels"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == (
        "ModuleNotFoundError: fastformer's ops (fastformer.kernels) are not installed: setup.py installs "
        "the repository's kernels/ folder under that name; from a checkout, run `pip install -e .` first"
    )


def _python_at_the_root(code, pythonpath=()):
    """Run `code` in a fresh interpreter from the checkout's root, where the README's commands run
    and the folder kernels/ is importable as `kernels`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, pythonpath))}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_at_the_root_import_kernels_is_an_empty_package_that_names_the_right_import():
    """`import kernels` from the root succeeds (libraries probe for that name and read its
    __version__), loads none of the ops, and any use of it says `from fastformer import kernels`;
    that import still works in the same process."""
    out = _python_at_the_root(
        "import sys, kernels\n"
        "assert getattr(kernels, '__version__', 'N/A') == 'N/A'\n"
        "loaded = [name for name in sys.modules if name.startswith('kernels.')]\n"
        "assert loaded == ['kernels._stand_aside'], loaded\n"
        "for use in ('kernels.attention', 'from kernels import attention', 'import kernels.attention'):\n"
        "    try:\n"
        "        exec(use if ' ' in use else 'x = ' + use)\n"
        "    except ImportError as error:\n"
        "        print(use, '->', error)\n"
        "    else:\n"
        "        raise AssertionError(use + ' worked')\n"
        "from fastformer import kernels as ops\n"
        "print(ops.__name__, ops.attention.__module__)\n"
    )
    assert out.count("use `from fastformer import kernels`") == 2, out
    assert "fastformer.kernels fastformer.kernels.attention" in out


def test_at_the_root_import_kernels_is_the_other_project_where_it_is_installed(tmp_path):
    """With another `kernels` on the path (the PyPI project's name), `import kernels` from the root
    gives that project, and fastformer.kernels stays ours."""
    other = tmp_path / "site" / "kernels"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("__version__ = '0.9.0'\ndef get_kernel(name):\n    return name\n")
    out = _python_at_the_root(
        "import kernels\n"
        "print(kernels.__file__, kernels.__version__, kernels.get_kernel('x'))\n"
        "from fastformer import kernels as ops\n"
        "print(ops.__name__)\n",
        pythonpath=[tmp_path / "site"],
    )
    assert f"{other / '__init__.py'} 0.9.0 x" in out and "fastformer.kernels" in out


def test_transformers_modeling_code_imports_at_the_root():
    """transformers imports `kernels` to read its version when it finds that name: from the root it
    finds the folder kernels/, which must not break `from transformers import PreTrainedModel`."""
    pytest.importorskip("transformers", reason="transformers is not installed here")
    out = _python_at_the_root("from transformers import PreTrainedModel\nprint(PreTrainedModel.__name__)\n")
    assert "PreTrainedModel" in out


def test_setup_ships_the_kernels_folder_inside_fastformer():
    setup = (REPO / "setup.py").read_text()
    assert 'package_dir={"fastformer.kernels": "kernels"}' in setup
    assert '"kernels.*"' not in setup and 'include=["kernels"' not in setup


def test_setup_declares_the_licence():
    """LICENSE holds the BSD 3-Clause licence, and the package metadata declares it (License:
    BSD-3-Clause and the classifier); docs/licences.md says which outside data has which licence."""
    licence = (REPO / "LICENSE").read_text(encoding="utf-8")
    assert licence.startswith("BSD 3-Clause License") and "Copyright (c) 2026, the fastformer authors" in licence
    setup = (REPO / "setup.py").read_text()
    assert 'license="BSD-3-Clause"' in setup
    assert '"License :: OSI Approved :: BSD License"' in setup


def _run(python, *args, cwd):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of the checkout on the path
    result = subprocess.run([str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{' '.join(map(str, args))}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.mark.network
def test_installs_beside_the_pypi_kernels_project(tmp_path):
    """A fresh venv (reusing this one's torch and Triton through a .pth) with fastformer installed
    from this checkout (not editable) and `pip install kernels`: `import kernels` is the other
    project, fastformer.kernels is ours, and fastformer's tests pass there, run from a copy of
    tests/ so that the checkout is not on the path."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path).strip())
    (site / "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # installed from a copy: building writes build/ and an egg-info next to setup.py
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "runs", "__pycache__"))
    _run(python, "-m", "pip", "install", "-q", "--no-deps", str(source), cwd=tmp_path)
    _run(python, "-m", "pip", "install", "-q", "kernels", cwd=tmp_path)

    check = (
        "import importlib.metadata as md, pathlib, kernels, fastformer.kernels as ops\n"
        "own = {str(f) for f in md.files('kernels')}\n"
        "assert 'kernels/__init__.py' in own, sorted(own)[:5]\n"
        "assert not any(f.startswith('kernels/') for f in map(str, md.files('fastformer'))), "
        "'fastformer wrote into kernels/'\n"
        "assert pathlib.Path(kernels.__file__).parent.name == 'kernels' and hasattr(kernels, 'get_kernel')\n"
        "assert ops.__name__ == 'fastformer.kernels' and hasattr(ops, 'attention')\n"
    )
    _run(python, "-c", check, cwd=tmp_path)

    shutil.copytree(REPO / "tests", tmp_path / "tests")
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    out = _run(
        python,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "not network",
        "tests/test_backend.py",
        "tests/test_dropout_bits.py",
        "tests/test_drop_in.py",
        cwd=tmp_path,
    )
    assert " passed" in out and "failed" not in out
    assert fastformer.__version__ in _run(python, "-m", "pip", "show", "fastformer", cwd=tmp_path)
