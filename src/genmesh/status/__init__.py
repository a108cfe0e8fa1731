"""`genmesh status`: the mesh as it is, from discovery and from `$SRV` (docs/status.md)."""
