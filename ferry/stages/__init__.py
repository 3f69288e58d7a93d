"""Training stages as one recorded pipeline: each stage a run, started from its parent's checkpoint, its
lineage (parent digest, config, data, seed, code) kept beside the stages."""

from ferry.stages.lineage import Lineage
from ferry.stages.runner import run_pipeline
from ferry.stages.show import lineage_lines
from ferry.stages.spec import PipelineSpec, StageSpec, load_pipeline, stage_configs

__all__ = ["Lineage", "PipelineSpec", "StageSpec", "lineage_lines", "load_pipeline", "run_pipeline", "stage_configs"]
