"""SpikingJelly's neuromorphic datasets (``spikingjelly.datasets``) from local files.

:class:`DVS128Gesture`, :class:`CIFAR10DVS`, :class:`NMNIST` and
:class:`SpikingHeidelbergDigits` (alias ``SHD``) take SpikingJelly's arguments (``root``,
``train``, ``data_type='event'|'frame'``, ``frames_number`` + ``split_by``, ``duration``,
``custom_integrate_function``, transforms) and give its samples, frames and labels. Nothing is
downloaded: a missing file raises, saying which files to put where. The readers of the
published formats and the integration functions are in :mod:`spikefuse.datasets.events`.
"""

from .cifar10_dvs import CIFAR10DVS, CIFAR10DVS_CLASS_NAMES
from .dvs128_gesture import DVS128Gesture
from .events import (
    cal_fixed_frames_number_segment_index,
    integrate_events_by_fixed_duration,
    integrate_events_by_fixed_frames_number,
    integrate_events_segment_to_frame,
    load_aedat_v3,
    load_ATIS_bin,
    load_cifar10dvs_aedat,
)
from .folder import (
    NeuromorphicDatasetConfig,
    NeuromorphicDatasetFolder,
    load_npz_frames,
    split_to_train_test_set,
)
from .n_mnist import NMNIST
from .shd import SHD_N_CLASSES, SpikingHeidelbergDigits

SHD = SpikingHeidelbergDigits

__all__ = [
    "CIFAR10DVS",
    "CIFAR10DVS_CLASS_NAMES",
    "DVS128Gesture",
    "NMNIST",
    "SHD",
    "SHD_N_CLASSES",
    "NeuromorphicDatasetConfig",
    "NeuromorphicDatasetFolder",
    "SpikingHeidelbergDigits",
    "cal_fixed_frames_number_segment_index",
    "integrate_events_by_fixed_duration",
    "integrate_events_by_fixed_frames_number",
    "integrate_events_segment_to_frame",
    "load_ATIS_bin",
    "load_aedat_v3",
    "load_cifar10dvs_aedat",
    "load_npz_frames",
    "split_to_train_test_set",
]
