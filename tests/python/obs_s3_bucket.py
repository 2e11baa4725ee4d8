"""Creates an S3 bucket on a local moto server: obs_s3_bucket.py ENDPOINT BUCKET."""
import sys

import boto3

endpoint, bucket = sys.argv[1], sys.argv[2]
s3 = boto3.client(
    "s3",
    endpoint_url=endpoint,
    aws_access_key_id="test",
    aws_secret_access_key="test",
    region_name="us-east-1",
)
s3.create_bucket(Bucket=bucket)
