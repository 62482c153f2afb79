"""Real text for data tests, made locally: the standard library's source and docstrings as JSONL and
Parquet corpora, and a BPE tokenizer trained on that text (no network).

Documents: one per module (its source) and one per documented function (its docstring), in a
fixed order, so a corpus built twice is the same bytes. Sizes stay small: tests build in well
under a second, and the benchmark asks for more modules.
"""

from __future__ import annotations

import ast
import gzip
import json
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2; </s> is the EOS
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def stdlib_modules(limit: int, skip: int = 0) -> list[Path]:
    """The first ``limit`` top-level stdlib modules (after ``skip``), sorted by name."""
    names = sorted(n for n in sys.stdlib_module_names if not n.startswith("_"))
    found = [STDLIB / f"{n}.py" for n in names if (STDLIB / f"{n}.py").is_file()]
    return found[skip : skip + limit]


def documents(num_modules: int, skip: int = 0) -> Iterator[dict[str, str]]:
    """``{"id", "text"}`` records: each module's source, then its functions' docstrings."""
    for path in stdlib_modules(num_modules, skip):
        source = path.read_text(encoding="utf-8", errors="replace")
        yield {"id": path.stem, "text": source}
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    yield {"id": f"{path.stem}.{node.name}", "text": doc}


def write_jsonl(path: Path, records: Sequence[dict[str, str]]) -> Path:
    """One JSON object per line; ``.gz`` and ``.zst`` names are compressed (fixed mtime: same bytes)."""
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.name.endswith(".gz"):
        data = gzip.compress(data, mtime=0)
    elif path.name.endswith(".zst"):
        import zstandard

        # with the content checksum, as the zstd command line writes by default
        data = zstandard.ZstdCompressor(write_checksum=True).compress(data)
    path.write_bytes(data)
    return path


def write_parquet(path: Path, records: Sequence[dict[str, str]], row_group_size: int = 256) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": [r["id"] for r in records], "text": [r["text"] for r in records]})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def build_corpus(folder: Path, num_modules: int = 24, num_files: int = 3, row_group_size: int = 256) -> list[Path]:
    """``num_files`` files of the stdlib documents, mixing JSONL (plain, .gz, .zst) and Parquet
    (``row_group_size`` rows per group)."""
    records = list(documents(num_modules))
    kinds = [".jsonl", ".jsonl.gz", ".parquet", ".jsonl.zst"]
    per_file = -(-len(records) // num_files)
    files = []
    for i in range(num_files):
        part = records[i * per_file : (i + 1) * per_file]
        path = folder / f"part-{i:03d}{kinds[i % len(kinds)]}"
        files.append(write_parquet(path, part, row_group_size) if path.suffix == ".parquet" else write_jsonl(path, part))
    return files


def save_tokenizer(folder: Path, num_modules: int = 24, vocab_size: int = 1024) -> Path:
    """A byte-level BPE tokenizer trained on the stdlib documents, saved as ``folder/tokenizer.json``
    with a tokenizer_config.json naming its EOS (as a model folder has); returns the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = (r["text"] for r in documents(num_modules))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )
    return folder
