"""The strategy conformance suite, run against the test plugin's ``linear`` strategy."""

import torch

from fixtures.linear_plugin import LinearOptions, LinearStrategy
from specforge_core.protocols import BuildContext
from specforge_core.testing import StrategyConformance


class TestLinearStrategyConformance(StrategyConformance):
    def make_strategy(self):
        return LinearStrategy(LinearOptions(), BuildContext())

    def make_target(self):
        info, frozen = super().make_target()
        return info, {"proj": torch.eye(info.hidden_size)}


class ExportingLinear(LinearStrategy):
    """``linear`` with an export written as docs/writing-plugins.md gives it: ``fmt`` and ``dtype`` keyword-only and
    required, as `specforge export` passes them."""

    calls: list = []

    def export(self, model, out_dir, target, *, fmt, dtype):
        from safetensors.torch import save_file

        self.calls.append((fmt, dtype))
        save_file({name: (param.detach().to(getattr(torch, dtype)) if param.requires_grad else param.detach()).contiguous()
                   for name, param in model.named_parameters()}, f"{out_dir}/model.safetensors")

    def load_export(self, path, target, frozen_parts):
        from safetensors.torch import load_file

        model = self.build_model(target, frozen_parts, None)
        for name, tensor in load_file(f"{path}/model.safetensors").items():
            model.get_parameter(name).data = tensor
        return model


class TestExportWithRequiredFormatAndDtypeConformance(TestLinearStrategyConformance):
    export_format = "linear-safetensors"

    def make_strategy(self):
        return ExportingLinear(LinearOptions(), BuildContext())

    def test_the_round_trip_passes_the_format_and_dtype_as_specforge_export_does(self):
        ExportingLinear.calls.clear()
        self.test_export_round_trip_gives_identical_outputs()
        assert ExportingLinear.calls == [("linear-safetensors", "bfloat16")]
