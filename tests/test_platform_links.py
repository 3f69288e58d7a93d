"""Every platform says what links its accelerators and its nodes, per accelerator and one way, each figure with
its kind (a datasheet's peak, arithmetic on a cited figure, a measurement) and its source: what a planner prices a
collective on. An inter-node figure derived from the node's network must be that network's share."""

from __future__ import annotations

import pytest
import yaml

from ferry.config import ConfigError
from ferry.config.loader import validate
from ferry.launch.platform import PLATFORM_DIR, Platform, load_platform, platform_names


@pytest.mark.parametrize("name", platform_names())
def test_each_platform_prices_both_tiers_with_sources(name):
    platform = load_platform(name)
    intra, inter = platform.links.intra_node, platform.links.inter_node
    assert inter.gbytes_per_s is not None and len(inter.source) > 40 and len(intra.source) > 40
    if intra.gbytes_per_s is not None:
        assert intra.gbytes_per_s > 4 * inter.gbytes_per_s, "a node's own links are the fast tier"
    if intra.pair_gbytes_per_s is not None:
        assert intra.pair_gbytes_per_s < intra.gbytes_per_s, "one pair of a mesh gets one link of the whole"


def test_the_accelerator_platforms_have_the_published_tiers():
    assert load_platform("p5.48xlarge").links.intra_node.gbytes_per_s == 450  # NVLink4: 900 GB/s both ways
    assert load_platform("p6-b200.48xlarge").links.intra_node.gbytes_per_s == 900  # NVLink5: 1.8 TB/s both ways
    mesh = load_platform("mi300x-8").links.intra_node
    assert (mesh.gbytes_per_s, mesh.pair_gbytes_per_s) == (448, 64)  # 7 xGMI links of 64 GB/s a direction
    assert load_platform("p6-b300.48xlarge").links.inter_node.gbytes_per_s == 100  # 6,400 Gbps over 8 GPUs
    assert load_platform("cpu").links.intra_node.figure == "unmeasured"


def test_a_derived_figure_that_is_not_the_networks_share_is_refused():
    raw = yaml.safe_load((PLATFORM_DIR / "p5.48xlarge.yaml").read_text())
    raw["links"]["inter_node"]["gbytes_per_s"] = 400  # the node's total, not a GPU's share
    with pytest.raises(ConfigError, match=r"links.inter_node.gbytes_per_s 400.0 is derived"):
        validate(Platform, raw)
    raw["links"]["inter_node"]["gbytes_per_s"] = 50
    raw["links"]["intra_node"]["figure"] = "unmeasured"
    with pytest.raises(ConfigError, match="gbytes_per_s is given exactly when the figure is not unmeasured"):
        validate(Platform, raw)
