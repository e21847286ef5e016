"""Staged files written straight from the tensors (verl_core.rollout.weight_sync.write_safetensors): what
safetensors' own loader reads back, tied names twice, casts, buckets, no copy of a CPU tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from verl_core.errors import ConfigError
from verl_core.rollout import weight_sync
from verl_core.rollout.weight_sync import stage_weights, staged_names, write_safetensors


def test_safetensors_reads_back_every_dtype_shape_and_tied_name(tmp_path: Path) -> None:
    emb = torch.randn(5, 3)
    tensors = [
        ("embed.weight", emb),
        ("scalar", torch.tensor(2.5, dtype=torch.float64)),
        ("empty", torch.zeros(0, 4)),
        ("ids", torch.arange(7, dtype=torch.int32)),
        ("mask", torch.tensor([True, False, True])),
        ("half", torch.randn(2, 3).to(torch.bfloat16)),
        ("strided", torch.randn(4, 6)[:, ::2]),  # not contiguous: written as its values
        ("lm_head.weight", emb),  # tied: the same storage under a second name
    ]
    write_safetensors(tensors, tmp_path / "a.safetensors")
    back = load_file(tmp_path / "a.safetensors")
    assert set(back) == {n for n, _ in tensors}
    for name, t in tensors:
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
        assert torch.equal(back[name], t), name
    # the data starts 8-byte aligned after the header, as safetensors pads it
    raw = (tmp_path / "a.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert n % 8 == 0 and json.loads(raw[8 : 8 + n])["lm_head.weight"]["dtype"] == "F32"


def test_floating_tensors_cast_on_write_others_kept(tmp_path: Path) -> None:
    # 1 + 2^-9 rounds to 1.0 in bf16 (half a step, to even): the rounding of Tensor.to
    w = torch.tensor([1.0, 1.0 + 2**-9, 3.0])
    write_safetensors([("w", w), ("steps", torch.arange(3))], tmp_path / "b.safetensors", torch.bfloat16)
    back = load_file(tmp_path / "b.safetensors")
    assert back["w"].dtype == torch.bfloat16 and back["w"].tolist() == [1.0, 1.0, 3.0]
    assert back["steps"].dtype == torch.int64


def test_buckets_split_by_bytes_in_order(tmp_path: Path) -> None:
    # 3 tensors of 400 bytes in buckets of 1,000: two in the first file, the third in the next
    ws = [(f"t{i}", torch.full((100,), float(i))) for i in range(3)]
    assert stage_weights(ws, tmp_path, bucket_bytes=1000) == ["t0", "t1", "t2"]
    files = sorted(tmp_path.glob("*.safetensors"))
    assert [sorted(load_file(f)) for f in files] == [["t0", "t1"], ["t2"]]
    assert staged_names(tmp_path) == ["t0", "t1", "t2"]
    with safe_open(files[0], "pt") as f:
        assert torch.equal(f.get_tensor("t1"), torch.full((100,), 1.0))
    with pytest.raises(ConfigError, match="sent twice"):
        stage_weights([ws[0], ws[0]], tmp_path / "again", bucket_bytes=1000)


def test_a_cpu_contiguous_tensor_is_not_copied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the bytes handed to the file are a view of the tensor's own storage
    seen: list[int] = []
    real = torch.Tensor.numpy

    def numpy(self: torch.Tensor, *a: object, **k: object) -> object:
        seen.append(self.data_ptr())
        return real(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "numpy", numpy)
    w = torch.randn(64, 8)
    write_safetensors([("w", w)], tmp_path / "c.safetensors")
    assert seen == [w.data_ptr()]
    with pytest.raises(ConfigError, match="not a safetensors dtype"):
        write_safetensors([("c", torch.zeros(2, dtype=torch.complex64))], tmp_path / "d.safetensors")
    assert weight_sync.SAFETENSORS_DTYPES[torch.bfloat16] == "BF16"
