"""prime_async.utils"""
