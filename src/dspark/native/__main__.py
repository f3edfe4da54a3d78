"""``python -m dspark.native``: build the native kernels for this machine now (ahead of the first model load) and
print which paths they run; exit status 1 when they cannot be built (dspark then uses its PyTorch paths)."""

from __future__ import annotations

import sys

import dspark.native as native


def main() -> int:
    if not native.enabled():
        print(native.status())
        return 0
    try:
        native.build(verbose="-v" in sys.argv[1:])
    except Exception as e:  # noqa: BLE001 - report any compiler failure as one line
        print(f"dspark native kernels: build failed ({type(e).__name__}: {str(e).strip().splitlines()[0]})")
        return 1
    print(f"dspark native kernels: {native.status()}")
    return 0 if native.available() else 1


if __name__ == "__main__":
    raise SystemExit(main())
