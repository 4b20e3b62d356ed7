"""A decode step runs PyTorch's small ops on one thread and the C kernels on the threads PyTorch had
(`kernels.threads`); wide PyTorch work inside the step gets every thread back."""

from __future__ import annotations

import threading

import pytest
import torch

import verispec
from conftest import tiny_llama
from verispec.drafters.ngram import NgramDrafter
from verispec.engine import DecodeBatch, Request
from verispec.models import kernels
from verispec.models.native import NativeCausalLM
from verispec.policy import FixedDraftLen


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_scope_keeps_the_kernels_count_and_restores(two_threads):
    assert kernels.threads() == 2
    with kernels.torch_on_one_thread():
        assert (torch.get_num_threads(), kernels.threads()) == (1, 2)
        with kernels.torch_threads():
            assert (torch.get_num_threads(), kernels.threads()) == (2, 2)
        assert (torch.get_num_threads(), kernels.threads()) == (1, 2)
        with kernels.torch_on_one_thread(kernel_threads=1):  # a head's few width-1 passes
            assert (torch.get_num_threads(), kernels.threads()) == (1, 1)
        assert (torch.get_num_threads(), kernels.threads()) == (1, 2)
    assert (torch.get_num_threads(), kernels.threads()) == (2, 2)
    with kernels.torch_threads():  # outside a step it changes nothing
        assert (torch.get_num_threads(), kernels.threads()) == (2, 2)


def test_scopes_on_two_threads_leave_no_count_behind(two_threads):
    """A scope entered inside another thread's and left after it (a server's worker stepping while another
    thread decodes) must not leave its kernel count to the process: each thread's count is its own."""
    entered, leave_first, left_first = threading.Event(), threading.Event(), threading.Event()
    inside: list[int] = []

    def worker():
        with kernels.torch_on_one_thread(1):
            entered.set()
            leave_first.wait(10)
            inside.append(kernels.threads())
        left_first.set()

    thread = threading.Thread(target=worker)
    thread.start()
    entered.wait(10)
    with kernels.torch_on_one_thread():  # entered while the worker's scope is open ...
        assert kernels.threads() == 2  # ... and not given the worker's count
        leave_first.set()
        left_first.wait(10)  # the worker's scope closes first
        assert kernels.threads() == 2
    thread.join(10)
    assert inside == [1]
    assert (torch.get_num_threads(), kernels.threads()) == (2, 2)


def test_scope_restores_after_an_error(two_threads):
    with pytest.raises(RuntimeError):
        with kernels.torch_on_one_thread():
            raise RuntimeError("boom")
    assert (torch.get_num_threads(), kernels.threads()) == (2, 2)


class RecordingDrafter(NgramDrafter):
    """An n-gram drafter that notes the thread counts its proposals ran under."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[int, int]] = []

    def propose(self, *args, **kwargs):
        self.seen.append((torch.get_num_threads(), kernels.threads()))
        return super().propose(*args, **kwargs)


def test_a_decode_step_splits_the_threads_and_a_wide_pass_takes_them_back(two_threads, monkeypatch):
    target = NativeCausalLM.from_hf(tiny_llama(seed=0))
    passes: list[tuple[int, int]] = []
    big_pass = NativeCausalLM._big_pass

    def recording_big_pass(self, *args, **kwargs):
        passes.append((torch.get_num_threads(), args[0].shape[1]))
        return big_pass(self, *args, **kwargs)

    monkeypatch.setattr(NativeCausalLM, "_big_pass", recording_big_pass)
    drafter = RecordingDrafter()
    prompt = [1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    batch = DecodeBatch(target, drafter, FixedDraftLen(3))
    batch.add([Request(prompt=prompt, max_new_tokens=8, id=0)])
    tokens = []
    while len(batch):
        tokens += [t for event in batch.step() for t in event.tokens]
    assert tokens == verispec.generate(target, prompt, max_new_tokens=8, drafter="none").token_ids
    assert drafter.seen and set(drafter.seen) == {(1, 2)}
    assert torch.get_num_threads() == 2 and kernels.threads() == 2

    with kernels.torch_on_one_thread():  # a prompt wider than a small pass, read inside a step's scope
        target.forward(torch.arange(kernels.MAX_ROWS + 4)[None] % 50 + 1, target.new_cache(1))
    assert passes[-1] == (2, kernels.MAX_ROWS + 4)
