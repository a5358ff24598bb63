"""Analyses that read host programs without running them on data: the dry
run of every rank on meta tensors with cross-rank matching of their
communications (`dry_run`), and the static stream-race checker (`races`)."""
