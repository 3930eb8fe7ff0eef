"""OpenAI's Batch API, host side: uploaded files and batches owned by their tenant, kept in
SQLite (WAL) under the data directory (store.py), and run line by line in the background through
a line executor the serving layer provides (service.py), resumed after a restart."""
