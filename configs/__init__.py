"""The shipped cluster configs (local.yaml is what `ember up` runs by default)."""
