"""Host-to-device staging on the CPU (the CUDA path runs in the engine's GPU tests)."""

import pytest
import torch
from jackfield.ops import CpuGpuBuffer, async_tensor_h2d


def test_async_tensor_h2d_from_list_and_tensor() -> None:
    out = async_tensor_h2d([3, 1, 4, 1, 5], torch.int32, "cpu", pin_memory=True)
    assert out.dtype == torch.int32 and out.tolist() == [3, 1, 4, 1, 5]
    src = torch.tensor([0.5, 1.5])
    out = async_tensor_h2d(src, torch.float64, "cpu", pin_memory=False)
    assert out.dtype == torch.float64 and out.tolist() == [0.5, 1.5]


def test_async_tensor_h2d_rejects_device_tensors() -> None:
    with pytest.raises(ValueError, match="stages host data"):
        async_tensor_h2d(torch.empty(3, device="meta"), torch.int32, "cpu", pin_memory=False)


def test_cpu_gpu_buffer_on_cpu_aliases_and_copies_prefix() -> None:
    buf = CpuGpuBuffer(6, 2, dtype=torch.int64, device="cpu")
    assert buf.gpu is buf.cpu  # no device: nothing to copy to
    assert not buf.cpu.is_pinned()  # pinning needs CUDA
    buf.cpu[:3] = torch.arange(6).reshape(3, 2)
    view = buf.copy_to_device(3)
    assert view.shape == (3, 2) and view.tolist() == [[0, 1], [2, 3], [4, 5]]
    assert buf.copy_to_device().shape == (6, 2)


def test_cpu_gpu_buffer_numpy_view_writes_the_host_tensor(rng_seed: int) -> None:
    """What a CUDA graph's fill writes through `.np` is what `copy_to_device` copies, as a new
    version of the device tensor (on the CPU the host tensor itself)."""
    print(f"seed {rng_seed}")
    values = torch.randint(-1000, 1000, (5, 3), generator=torch.Generator().manual_seed(rng_seed))
    buf = CpuGpuBuffer(8, 3, dtype=torch.int32, device="cpu")
    buf.cpu.fill_(7)
    version = buf.cpu._version
    buf.np[:5] = values.numpy()
    copied = buf.copy_to_device(5)
    assert torch.equal(copied, values.to(torch.int32))
    assert (buf.cpu[5:] == 7).all()
    # the checks that read a tensor once per version (slot ranges) must see the new values
    assert copied._version > version


def test_cpu_gpu_buffer_rejects_bad_row_count() -> None:
    buf = CpuGpuBuffer(4, dtype=torch.int32, device="cpu")
    with pytest.raises(ValueError, match="cannot copy 5 rows"):
        buf.copy_to_device(5)
    with pytest.raises(ValueError, match="cannot copy -1 rows"):
        buf.copy_to_device(-1)


@pytest.mark.gpu
def test_cpu_gpu_buffer_on_cuda_is_pinned_and_copies() -> None:
    buf = CpuGpuBuffer(8, dtype=torch.int32, device="cuda")
    assert buf.cpu.is_pinned() and buf.gpu.device.type == "cuda"
    buf.cpu[:5] = torch.arange(5, dtype=torch.int32)
    assert buf.copy_to_device(5).cpu().tolist() == [0, 1, 2, 3, 4]
    assert async_tensor_h2d([1, 2], torch.int64, "cuda", pin_memory=True).cpu().tolist() == [1, 2]


def test_host_single_threaded_restores_the_pool_even_on_error() -> None:
    from jackfield.ops.staging import host_single_threaded

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(RuntimeError, match="inside"):
            with host_single_threaded():
                assert torch.get_num_threads() == 1
                raise RuntimeError("inside")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
