"""The image recipes: sections present, base image pinned, the project installed and tested."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEF = ROOT / "containers" / "fsdp_workflow.def"
DOCKERFILE = ROOT / "containers" / "Dockerfile"
# A pinned tag names the torch and CUDA versions; an optional digest must be a full sha256.
PINNED = re.compile(r"^[\w.\-/]+:\d+\.\d+\.\d+-cuda\d+\.\d+[\w.\-]*(@sha256:[0-9a-f]{64})?$")
IMPORTS = ("torch", "transformers", "accelerate", "safetensors", "hydra", "fsdp_workflow")


def parse_def(text: str) -> tuple[dict, dict]:
    """Apptainer definition: header ``Key: value`` lines, then ``%section`` bodies."""
    header, sections, current = {}, {}, None
    for line in text.splitlines():
        if line.startswith("%"):
            current = line[1:].split()[0]
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
        elif ":" in line and not line.lstrip().startswith("#"):
            key, value = line.split(":", 1)
            header[key.strip()] = value.strip()
    return header, {k: "\n".join(v) for k, v in sections.items()}


def test_definition_file_sections_base_and_install() -> None:
    header, sections = parse_def(DEF.read_text())
    assert header["Bootstrap"] == "docker"
    assert PINNED.match(header["From"]), f"base image not pinned to a version tag: {header['From']}"
    for name in ("files", "environment", "post", "test", "runscript", "labels", "help"):
        assert name in sections, f"%{name} missing from {DEF}"
    files = {line.split()[0] for line in sections["files"].splitlines() if line.strip()}
    assert {"pyproject.toml", "fsdp_workflow"} <= files
    for src in files:
        assert (ROOT / src).exists(), f"%files copies {src}, which the repository does not have"
    assert re.search(r"pip install /opt/fsdp_workflow", sections["post"])
    assert "PYTHONNOUSERSITE=1" in sections["environment"]
    for module in IMPORTS:
        assert re.search(rf"\bimport\b.*\b{module}\b", sections["test"]), f"%test does not import {module}"
    assert 'exec python -m fsdp_workflow "$@"' in sections["runscript"]


def test_dockerfile_matches_the_definition() -> None:
    text = DOCKERFILE.read_text()
    base = re.search(r"^FROM\s+(\S+)", text, re.M).group(1)
    def_base = parse_def(DEF.read_text())[0]["From"]
    assert PINNED.match(base) and base == def_base, "both recipes start from the same pinned image"
    assert "pip install /opt/fsdp_workflow" in text
    assert re.search(r"ENV[^\n]*PYTHONNOUSERSITE=1", text)
    for module in IMPORTS:
        assert re.search(rf"RUN python -c \"import [^\"]*\b{module}\b", text), f"no import test for {module}"
    for src in re.findall(r"^COPY\s+(.+)\s+\S+$", text, re.M):
        for path in src.split():
            assert (ROOT / path).exists(), f"COPY {path}: not in the repository"
    assert 'CMD ["python", "-m", "fsdp_workflow"]' in text


def _links_out_of(src: Path) -> set[Path]:
    """Where the links under ``src`` point, for those that point outside it."""
    return {(p.parent / p.readlink()).resolve().relative_to(ROOT) for p in [src, *src.rglob("*")]
            if p.is_symlink() and not (p.parent / p.readlink()).resolve().is_relative_to(src.resolve())}


def test_both_recipes_copy_what_the_package_links_to() -> None:
    """``fsdp_workflow/conf`` links to the top-level ``conf/``: an image copying only the package gets a dangling link."""
    copied = {
        DEF: {line.split()[0] for line in parse_def(DEF.read_text())[1]["files"].splitlines() if line.strip()},
        DOCKERFILE: {p for src in re.findall(r"^COPY\s+(.+)\s+\S+$", DOCKERFILE.read_text(), re.M)
                     for p in src.split()},
    }
    assert Path("conf") in _links_out_of(ROOT / "fsdp_workflow")
    for recipe, paths in copied.items():
        needed = set().union(*(_links_out_of(ROOT / p) for p in paths if (ROOT / p).is_dir()))
        missing = sorted(str(n) for n in needed if str(n) not in paths)
        assert not missing, f"{recipe.name} copies links into {missing} without copying those paths: copy them too"
