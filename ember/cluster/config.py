"""The cluster config is the edge-placement config (ember.placement.config); re-exported here
for the launcher and services."""
from ember.placement.config import ClusterConfig, EngineSettings, Site, load_config

__all__ = ["ClusterConfig", "EngineSettings", "Site", "load_config"]
