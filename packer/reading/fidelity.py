"""How far one decoder's pixels are from another's on the same samples: PSNR and the largest difference, the
figures the docs give (``benchmarks/decoder_fidelity.py``) for ``decoder="fast"`` against the default, and the
default against ``decoder="pil"`` (torchvision's Pillow pipeline). No torch: the decodes go through
:meth:`~packer.reading.decoding.Decoding.decode_array`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .decoding import Decoding


@dataclass(frozen=True)
class Fidelity:
    """One decoder against a reference decoder over some samples.

    Attributes:
        samples: how many samples were compared.
        worst_psnr: the lowest PSNR of one sample's image (dB; ``inf`` when every image is identical).
        median_psnr: the median of the samples' PSNRs (dB).
        max_diff: the largest difference of one pixel channel, in levels.
        identical: the share of pixel channels that are equal.
    """

    samples: int
    worst_psnr: float
    median_psnr: float
    max_diff: int
    identical: float

    def __str__(self) -> str:
        return (f"PSNR worst {self.worst_psnr:.1f} dB, median {self.median_psnr:.1f} dB, at most {self.max_diff} "
                f"level{'' if self.max_diff == 1 else 's'} apart, {self.identical:.1%} identical "
                f"({self.samples} images)")


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio of two uint8 images of one shape, in dB (``inf`` when equal)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def compare(decoding: Decoding, reference: Decoding, indices: Sequence[int], epoch: int = 0) -> Fidelity:
    """``decoding``'s images of ``indices`` against ``reference``'s (the same reader's samples, another decoder).

    Args:
        decoding: the decoding to judge, e.g. ``open_dataset(root, resize=256, center_crop=224).decoding``.
        reference: the one to judge it by, e.g. the same with ``decoder="pil"``.
        indices: the samples to compare (an image each; both must give it the same shape).
        epoch: the epoch whose augmentation both apply (a random resized crop draws the same window in both).

    Returns:
        The :class:`Fidelity`.
    """
    scores, worst, same, total = [], 0, 0, 0
    for index in indices:
        sample = decoding.reader.read(index)
        got = decoding.decode_array(index, sample, epoch=epoch)
        want = reference.decode_array(index, reference.reader.read(index), epoch=epoch)
        if got.shape != want.shape:
            raise ValueError(f"{decoding.reader.describe(index)}: {got.shape} against {want.shape}")
        diff = np.abs(got.astype(np.int16) - want.astype(np.int16))
        scores.append(psnr(got, want))
        worst = max(worst, int(diff.max()))
        same += int(np.count_nonzero(diff == 0))
        total += diff.size
    if not scores:
        raise ValueError("no samples to compare")
    return Fidelity(len(scores), min(scores), float(np.median(scores)), worst, same / total)
