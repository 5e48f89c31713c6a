"""prime_async.inference"""
