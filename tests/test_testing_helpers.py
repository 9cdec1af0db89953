"""deploykit.testing: the helpers that make random models look trained."""

import torch

from deploykit.testing import calibrate_batch_norm


def test_calibrated_statistics_are_those_of_the_data_seen():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 5, 3), torch.nn.BatchNorm2d(5), torch.nn.ReLU())
    batches = [torch.randn(4, 3, 9, 7) * 3 + 1 for _ in range(3)]
    calibrate_batch_norm(model, batches, seed=2)
    norm = model[1]
    with torch.no_grad():
        seen = torch.cat([model[0](b) for b in batches]).transpose(0, 1).flatten(1)
    # the cumulative average of per-batch statistics (unbiased variances), as momentum=None keeps
    per_batch = [model[0](b).detach().transpose(0, 1).flatten(1) for b in batches]
    torch.testing.assert_close(norm.running_mean, seen.mean(1))
    torch.testing.assert_close(norm.running_var, torch.stack([p.var(1) for p in per_batch]).mean(0))
    assert norm.running_var.sub(1).abs().max() > 0.5 and norm.weight.sub(1).abs().max() > 0.05  # not the defaults
    assert norm.momentum == 0.1 and not model.training
