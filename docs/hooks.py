"""MkDocs hook: publish the committed benchmark plots (benchmarks/<gpu>/*.png) under
results/<gpu>/ so that the benchmark page shows the files the result sets hold, not copies."""

from __future__ import annotations

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for png in sorted((ROOT / "benchmarks").glob("*/*.png")):
        path = f"results/{png.parent.name}/{png.name}"
        files.append(File.generated(config, path, abs_src_path=str(png)))
    return files
