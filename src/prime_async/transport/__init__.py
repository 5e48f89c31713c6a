"""prime_async.transport"""
