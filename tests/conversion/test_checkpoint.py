"""State_dicts load into a ``--factory`` model as ``model.load_state_dict`` would load them.

torchvision's MNASNet reads its module version from the state_dict's ``_metadata`` and refuses a
state without it, so it fails wherever the metadata is dropped (it once was: exit 4). The slow
test loads every torchvision classification model's state_dict the same way.
"""

from __future__ import annotations

import collections
import itertools

import pytest
import torch
import torchvision

from deploykit.conversion.loading import load_model
from deploykit.errors import EXIT_BAD_INPUT, BadInputError

FACTORY = "torchvision.models:mnasnet0_5"


def assert_same_state(model: torch.nn.Module, reference: dict) -> None:
    loaded = model.state_dict()
    assert list(loaded) == list(reference)
    for key, tensor in reference.items():
        assert torch.equal(loaded[key], tensor), key


def saved(tmp_path, state) -> str:
    path = tmp_path / "weights.pt"
    torch.save(state, path)
    return path


def mnasnet_state() -> collections.OrderedDict:
    torch.manual_seed(0)
    return torchvision.models.mnasnet0_5().state_dict()


def test_mnasnet_state_dict_loads_with_its_versions(tmp_path):
    state = mnasnet_state()
    assert state._metadata[""]["version"] == 2  # what MNASNet's loader insists on
    loaded = load_model(saved(tmp_path, state), FACTORY)
    assert_same_state(loaded.module, state)
    assert loaded.input_names == ["x"]


def test_data_parallel_checkpoint_keeps_the_model_versions(tmp_path):
    """DataParallel prefixes tensor names and metadata paths with ``module``; its own entry
    (version 1) must not replace MNASNet's (version 2)."""
    state = mnasnet_state()
    wrapped = torch.nn.DataParallel(torchvision.models.mnasnet0_5())
    wrapped.module.load_state_dict(state)
    checkpoint = {"epoch": 3, "state_dict": wrapped.state_dict()}
    assert checkpoint["state_dict"]._metadata["module"]["version"] == 2
    loaded = load_model(saved(tmp_path, checkpoint), FACTORY)
    assert_same_state(loaded.module, state)


def rejected(tmp_path, state, factory: str = FACTORY) -> str:
    with pytest.raises(BadInputError) as caught:
        load_model(saved(tmp_path, state), factory)
    assert caught.value.exit_code == EXIT_BAD_INPUT
    return str(caught.value)


def test_missing_and_unexpected_keys_are_named(tmp_path):
    state = mnasnet_state()
    state.pop("classifier.1.bias")
    state["head.weight"] = torch.zeros(3)
    message = rejected(tmp_path, state)
    assert "1 missing key: classifier.1.bias" in message
    assert "1 unexpected key: head.weight" in message
    assert FACTORY in message and "architecture" in message


def test_many_missing_keys_are_counted(tmp_path):
    dropped = ("layers.0.", "layers.1.")  # the stem's conv (no bias) and its BatchNorm: 6 tensors
    state = mnasnet_state()
    for key in [k for k in state if k.startswith(dropped)]:
        del state[key]
    message = rejected(tmp_path, state)
    assert ("6 missing keys: layers.0.weight, layers.1.weight, layers.1.bias, layers.1.running_mean "
            "(+2 more)") in message
    assert "unexpected" not in message


def test_shape_mismatch_names_the_tensor(tmp_path):
    torch.manual_seed(0)
    message = rejected(tmp_path, torchvision.models.mnasnet1_0().state_dict())
    assert "does not load into the model built by" in message
    assert "size mismatch for layers.0.weight" in message
    assert "Error(s) in loading state_dict" not in message


def test_a_modules_own_refusal_is_bad_input(tmp_path):
    """A state built by hand without metadata: MNASNet's loader refuses it, as in a user's script."""
    state = dict(mnasnet_state())
    message = rejected(tmp_path, state)
    assert "version should be set to 1 or 2" in message


#: The torch.nn.init functions torchvision's classifiers initialise their weights with.
INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "xavier_uniform_",
                "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_")


@pytest.fixture
def cheap_initialisation(monkeypatch):
    """Every torch.nn.init call fills its tensor with a constant of its own instead of random
    numbers: a random init of all 128 models (twice each: the reference and the factory's build)
    took two of the test's three minutes and says nothing about loading. Tensors still differ from
    each other, so a value loaded under the wrong key fails the comparison."""
    values = itertools.count(1)

    def fill(tensor, *args, **kwargs):
        with torch.no_grad():
            return tensor.fill_(next(values) % 1009 / 1009)

    # nn.MultiheadAttention calls the xavier_uniform_ it imported by name.
    for module in (torch.nn.init, torch.nn.modules.activation):
        for name in INITIALISERS:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, fill)


def constants_as_views(state: collections.OrderedDict) -> collections.OrderedDict:
    """The state with each tensor whose elements are all equal saved as one element seen through
    zero strides: under cheap_initialisation that is nearly every weight, so vit_h_14's checkpoint
    takes kilobytes instead of 2.5 GB (CI's disk filled on it). torch.save keeps strides, so the file
    still loads through torch.load and load_state_dict as the full tensors would."""
    compact = collections.OrderedDict((key, _one_element_if_constant(tensor)) for key, tensor in state.items())
    compact._metadata = state._metadata
    return compact


def _one_element_if_constant(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.numel() <= 1:  # nothing to gain, and a 0-d tensor has no element to expand from
        return tensor
    first = tensor.flatten()[:1]
    return first.clone().expand(tensor.shape) if bool((tensor == first).all()) else tensor


@pytest.mark.slow
@pytest.mark.parametrize("name", torchvision.models.list_models(module=torchvision.models))
def test_every_torchvision_classifier_state_dict_loads(tmp_path, name, cheap_initialisation):
    state = torchvision.models.get_model(name).state_dict()
    checkpoint = saved(tmp_path, constants_as_views(state))
    assert_same_state(load_model(checkpoint, f"torchvision.models:{name}").module, state)
