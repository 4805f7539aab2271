"""Write a text corpus that ships with Python itself: the source files of the standard
library (their code, docstrings and comments), one text file each, for the preprocessing
recipe. Usage: make_corpus.py OUT_DIR [--limit N]"""

import argparse
import os
import sysconfig
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--limit", type=int, default=500, help="files to write at most")
    args = ap.parse_args()
    lib = Path(sysconfig.get_paths()["stdlib"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n = 0
    for path in sorted(lib.rglob("*.py")):
        rel = path.relative_to(lib)
        if rel.parts[0] in ("test", "site-packages", "idlelib", "lib2to3") or "tests" in rel.parts:
            continue
        dest = out / (rel.as_posix().replace("/", "__").removesuffix(".py") + ".txt")
        dest.write_bytes(path.read_bytes())
        n += 1
        if n >= args.limit:
            break
    print(f"wrote {n} text files into {out}")


if __name__ == "__main__":
    main()
