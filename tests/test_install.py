"""fastformer installs one top-level package: its ops are `fastformer.kernels`, never a top-level
`kernels`, which is another project's name on PyPI (the kernel-hub client used with Hugging Face
transformers). Installed side by side in one environment, each keeps its own files.

setup.py bounds torch and Triton to the versions CI tests, and the install line documented for a
machine without a GPU takes torch's CPU build.

The install tests need the package indexes (pip downloads `kernels`, its dependencies and
setuptools, and reads PyTorch's CPU index), so they are marked `network` and deselected by default:
`pytest -m network`.
"""

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

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


def _install_requires():
    """setup.py's install_requires, read from its source."""
    tree = ast.parse((REPO / "setup.py").read_text(encoding="utf-8"))
    setup = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup")
    requires = next(keyword.value for keyword in setup.keywords if keyword.arg == "install_requires")
    return {r.name: r for r in map(Requirement, ast.literal_eval(requires))}


# "torch 2.11 to 2.13, Triton 3.6 to 3.9", as the README, the install page and the testing page say it
SUPPORTED = re.compile(r"torch\s+(\d+\.\d+)\s+to\s+(\d+\.\d+),?\s+(?:and\s+)?Triton\s+(\d+\.\d+)\s+to\s+(\d+\.\d+)")


def _up_to(newest):
    """The bound below the minor version after `newest`: "2.13" -> "<2.14"."""
    major, minor = newest.split(".")
    return f"<{major}.{int(minor) + 1}"


def test_the_install_bounds_are_the_versions_ci_tests():
    """setup.py asks for torch and Triton from the oldest version CI tests to the newest: the
    oldest lane's pins and the newest lane's torch in .ci/run, the range the docs state."""
    stated = {
        page: SUPPORTED.findall((REPO / page).read_text(encoding="utf-8"))
        for page in ("README.md", "docs/install.md", "docs/testing.md")
    }
    ranges = {found for each in stated.values() for found in each}
    assert all(stated.values()) and len(ranges) == 1, stated
    ((torch_oldest, torch_newest, triton_oldest, triton_newest),) = ranges

    requires = _install_requires()
    assert requires["torch"].specifier == SpecifierSet(f">={torch_oldest},{_up_to(torch_newest)}")
    assert requires["triton"].specifier == SpecifierSet(f">={triton_oldest},{_up_to(triton_newest)}")
    assert str(requires["triton"].marker) == 'platform_system == "Linux"'

    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    torch_pins = sorted(map(Version, re.findall(r"\btorch==([\d.]+)", ci)))
    triton_pins = sorted(map(Version, re.findall(r"\btriton==([\d.]+)", ci)))
    assert torch_pins == [Version(torch_oldest), Version(torch_newest)], torch_pins  # the two lanes
    assert triton_pins == [Version(triton_oldest)], triton_pins  # the newest lane takes setup.py's newest
    assert all(requires["torch"].specifier.contains(pin) for pin in torch_pins)


def _documented_cpu_install():
    """The install line docs/install.md gives for a machine without a GPU, as arguments to pip."""
    block = (REPO / "docs" / "install.md").read_text(encoding="utf-8").split("```bash", 1)[1].split("```", 1)[0]
    (line,) = [line for line in block.splitlines() if "--extra-index-url" in line]
    words = shlex.split(line, comments=True)
    assert words[:2] == ["pip", "install"], line
    return words[2:]


def _run(python, *args, cwd):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of the checkout on the path
    result = subprocess.run([str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{' '.join(map(str, args))}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.mark.network
def test_installs_beside_the_pypi_kernels_project(tmp_path):
    """A fresh venv (reusing this one's torch and Triton through a .pth) with fastformer installed
    from this checkout (not editable) as the install line for a machine without a GPU installs it,
    its dependencies resolved within setup.py's bounds, and `pip install kernels`: `import kernels`
    is the other project, fastformer.kernels is ours, and fastformer's tests pass there, run from a
    copy of tests/ so that the checkout is not on the path."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path).strip())
    (site / "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # installed from a copy: building writes build/ and an egg-info next to setup.py
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "runs", "__pycache__"))
    # the documented line's options, with the copy in place of `-e .`
    options = [word for word in _documented_cpu_install() if word not in ("-e", ".")]
    _run(python, "-m", "pip", "install", "-q", str(source), *options, cwd=tmp_path)
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


@pytest.mark.network
def test_the_install_line_without_a_gpu_takes_torchs_cpu_build(tmp_path):
    """The install line docs/install.md and the README give for a machine without a GPU, run as
    written from a copy of the checkout in a bare venv, resolved by pip without installing
    (`--dry-run --report`): torch is the CPU build (a `+cpu` local version) within setup.py's
    bounds, and no CUDA library (an `nvidia-*` package) comes with it."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "runs", "__pycache__"))
    report = tmp_path / "report.json"
    install = ["-m", "pip", "install", *_documented_cpu_install()]
    _run(venv / "bin" / "python", *install, "-q", "--dry-run", "--ignore-installed", "--report", report, cwd=source)

    items = json.loads(report.read_text())["install"]
    resolved = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in items}
    torch = Version(resolved["torch"])
    assert torch.local == "cpu" and _install_requires()["torch"].specifier.contains(torch), resolved["torch"]
    assert not [name for name in resolved if name.startswith("nvidia-")], sorted(resolved)
