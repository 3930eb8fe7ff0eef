"""Retrieval (RAG): chunking, Flax embedder, SQLite store, FAISS + BM25 search, collections."""
