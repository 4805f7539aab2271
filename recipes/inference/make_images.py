"""Write the held-out half of scikit-learn's handwritten digits (it ships with the package)
as image files, one 8x8 greyscale PGM per digit named <index>_<label>.pgm, for the inference
recipe. Usage: make_images.py OUT_DIR"""

import sys
from pathlib import Path

from sklearn.datasets import load_digits


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    digits = load_digits()
    half = len(digits.images) // 2
    for i in range(half, len(digits.images)):
        pixels = digits.images[i].astype(int)  # 0..16
        rows = "\n".join(" ".join(str(v) for v in row) for row in pixels)
        sub = out / f"{i % 10}"
        sub.mkdir(exist_ok=True)
        (sub / f"{i:04d}_{digits.target[i]}.pgm").write_text(f"P2\n8 8\n16\n{rows}\n")
    print(f"wrote {len(digits.images) - half} images into {out}")


if __name__ == "__main__":
    main()
