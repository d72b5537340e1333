# The C extension in jpeg_window.c (see packer/images/jpeg_window.py).
import numpy as np

LIBJPEG_TURBO: str

def decode(data: bytes | memoryview, out: np.ndarray, gray: bool, denom: int, left: int, top: int, right: int,
           bottom: int, /) -> tuple[int, int, int, int, int]: ...
