"""prime_async.entrypoints"""
