"""Calibration samples fitted to a model's inputs, and the clear errors when they do not fit
(farm/core/calibration.py)."""

from __future__ import annotations

import numpy as np
import pytest

from farm.core.calibration import load_samples
from farm.core.compression import MIN_CALIBRATION_SAMPLES, calibration_files
from farm.core.errors import CalibrationError
from farm.core.reference import InputSpec

IMAGE = InputSpec("image", (1, 3, 4, 4), "float32")


def _samples(folder, inputs):
    return load_samples(calibration_files(folder), inputs)


def test_one_sample_per_file_a_stack_or_a_batch_split_all_count(tmp_path):
    rng = np.random.default_rng(0)
    np.save(tmp_path / "a.npy", rng.random((1, 3, 4, 4)))  # one sample, float64: cast
    np.save(tmp_path / "b.npy", rng.random((4, 1, 3, 4, 4)).astype(np.float32))  # a stack
    np.save(tmp_path / "c.npy", rng.random((5, 3, 4, 4)).astype(np.float32))  # batch-1 split
    samples = _samples(tmp_path, [IMAGE])
    assert len(samples) == 10
    assert all(s["image"].shape == (1, 3, 4, 4) for s in samples)
    assert all(s["image"].dtype == np.float32 for s in samples)
    # In the files' sorted order, each file's samples in order.
    np.testing.assert_array_equal(samples[-1]["image"], np.load(tmp_path / "c.npy")[4:5])


def test_npz_files_name_each_input(tmp_path):
    inputs = [InputSpec("ids", (1, -1), "int64"), InputSpec("mask", (1, -1), "int64")]
    for index in range(MIN_CALIBRATION_SAMPLES):
        ids = np.arange(index + 2, dtype=np.int32)[None]  # int32 ids: cast to the input's int64
        np.savez(tmp_path / f"s{index:02}.npz", ids=ids, mask=np.ones_like(ids))
    samples = _samples(tmp_path, inputs)
    assert len(samples) == MIN_CALIBRATION_SAMPLES
    assert samples[3]["ids"].shape == (1, 5)  # a dynamic dimension takes any length
    assert samples[3]["ids"].dtype == np.int64


def test_too_few_samples_is_a_clear_error(tmp_path):
    np.save(tmp_path / "a.npy", np.zeros((3, 1, 3, 4, 4), np.float32))
    with pytest.raises(CalibrationError, match=r"3 sample\(s\), fewer than 10"):
        _samples(tmp_path, [IMAGE])


def test_a_wrong_shape_names_the_file_the_shape_and_the_input(tmp_path):
    np.save(tmp_path / "a.npy", np.zeros((1, 3, 8, 8), np.float32))
    with pytest.raises(
        CalibrationError,
        match=r"a\.npy: array of shape \[1, 3, 8, 8\] does not fit input 'image' of shape "
        r"\[1x3x4x4\]",
    ):
        _samples(tmp_path, [IMAGE])


@pytest.mark.parametrize(
    ("write", "says"),
    [
        (lambda p: np.save(p / "a.npy", np.zeros((1, 3, 4, 4), np.int64)), "int64 values for"),
        (lambda p: (p / "a.npy").write_bytes(b"not numpy"), "not a readable numpy array"),
        (lambda p: np.savez(p / "a.npz", other=np.zeros(3)), r"model's inputs are image"),
        (
            lambda p: np.save(p / "a.npy", np.array([{"x": 1}], dtype=object)),
            "not a readable numpy array",
        ),
    ],
)
def test_files_that_do_not_fit_are_refused(tmp_path, write, says):
    write(tmp_path)
    with pytest.raises(CalibrationError, match=says):
        _samples(tmp_path, [IMAGE])


def test_a_multi_input_model_needs_npz_files_and_equal_counts(tmp_path):
    inputs = [InputSpec("a", (1, 2), "float32"), InputSpec("b", (1, 2), "float32")]
    np.save(tmp_path / "x.npy", np.zeros((1, 2), np.float32))
    with pytest.raises(CalibrationError, match=r"give \.npz files with one array named after each"):
        _samples(tmp_path, inputs)
    (tmp_path / "x.npy").unlink()
    np.savez(tmp_path / "x.npz", a=np.zeros((3, 2), np.float32), b=np.zeros((2, 2), np.float32))
    with pytest.raises(CalibrationError, match=r"different numbers of samples \(a: 3, b: 2\)"):
        _samples(tmp_path, inputs)
