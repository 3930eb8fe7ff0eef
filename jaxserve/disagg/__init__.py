"""Prefill/decode disaggregation (`serve --role prefill|decode`): a decode server fronts the
client, has a prefill server compute the prompt's KV pages, receives them over HTTP on TCP and
generates. docs/disaggregation.md tells the whole shape."""
